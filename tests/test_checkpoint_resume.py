"""A resume at step k reproduces the uninterrupted run, in every precision: the losses of the
remaining steps and the final parameters bit for bit (CPU: the same layout sums the same
numbers in the same order), and the checkpoint each writes at the end holds the same tensors -
every parameter (the fp32 masters), every optimizer moment (Adam's two and its step), fp16's
loss scaler - so nothing a later resume needs was lost on the way.

The default run has one case per precision beyond fp32 (fp32 resumes are the default cases of
test_checkpoint.py and test_nd_checkpoint.py): ``single`` in bf16 (whose masters were once left
out: it resumed from its initial weights) and ``nd`` dp2 ZeRO-1 in fp16 at a rate that overflows
before the checkpoint (whose lowered loss scale was once left out). The rest are slow."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_same_checkpoint, final_state, losses

import dlab
from dlab.runtime import checkpoint_load

GPT = {"model": "gpt", "batch_size": 8, "optimizer": "adam", "steps": 6, "save_final": True,
       "model_options": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32}}
SAVED_AT = 3


def case(strategy: str, world: int, options: dict, lr: float, slow: bool = True):
    precision = options.get("precision", "bf16" if options.get("mixed_precision") else "fp32")
    layout = [f"{k}{v}" for k, v in options.items() if k not in ("precision", "mixed_precision")]
    return pytest.param(strategy, world, options, lr, id="-".join([strategy, *layout, precision]),
                        marks=[pytest.mark.slow] if slow else [])


CASES = [
    case("single", 1, {"precision": "bf16"}, 0.01, slow=False),
    case("nd", 2, {"dp": 2, "zero": 1, "precision": "fp16"}, 0.3, slow=False),
    case("single", 1, {}, 0.01),
    case("single", 1, {"precision": "fp16"}, 0.3),
    case("zero1", 2, {}, 0.01),
    case("zero3", 2, {"mixed_precision": True}, 0.01),
    case("nd", 2, {"dp": 2, "zero": 3}, 0.01),
    case("nd", 2, {"pp": 2, "precision": "bf16"}, 0.01),
    case("nd", 2, {"dp": 2, "zero": 2, "microbatches": 2, "precision": "bf16-fp32-grads"}, 0.01),
    case("nd", 2, {"dp": 2, "zero": 0, "precision": "fp16"}, 0.3),
]


def _step(run, step: int) -> checkpoint_load.Reader:
    return checkpoint_load.Reader(run.path / "checkpoints" / f"step-{step:08d}")


@pytest.mark.parametrize("strategy,world,options,lr", CASES)
def test_a_resume_reproduces_the_uninterrupted_run(strategy, world, options, lr, runs_dir):
    run = {**GPT, "lr": lr, "options": options, "checkpoint_every": SAVED_AT}
    clean = dlab.launch(strategy, world, runs_dir=runs_dir, wait=True, **run)
    saved = _step(clean, SAVED_AT)
    if options.get("precision") == "fp16":  # else the case would not test the scale's restore
        assert saved.scaler()["scale"] < 2.0 ** 16, f"no step overflowed before {SAVED_AT}"
    resumed = dlab.launch(strategy, world, runs_dir=runs_dir, wait=True, resume=str(saved.path),
                          **run)
    assert [m["step"] for m in resumed.metrics(0)] == list(range(SAVED_AT, GPT["steps"]))
    for r in range(world):
        assert losses(resumed, r) == losses(clean, r)[SAVED_AT:], r
        scaled = [(m.get("skipped"), m.get("loss_scale")) for m in resumed.metrics(r)]
        assert scaled == [(m.get("skipped"), m.get("loss_scale"))
                          for m in clean.metrics(r)][SAVED_AT:], r
        mine, want = final_state(resumed, r), final_state(clean, r)
        assert all(torch.equal(mine[k], want[k]) for k in want), r
    assert all(math.isfinite(x) for x in losses(clean))
    assert_same_checkpoint(_step(resumed, GPT["steps"]), _step(clean, GPT["steps"]))


@pytest.mark.slow  # the default run loads an nd checkpoint into single bf16 in test_checkpoint_state
def test_an_nd_bf16_checkpoint_goes_on_in_single_bf16(runs_dir):
    """``single`` bf16 resumed from ``nd`` dp2 ZeRO-2 bf16 goes on as nd did, to bf16's rounding:
    the losses to 2u of their decrease over the run (u = 2^-8, the bound and its derivation of
    test_nd_precision.py), where resuming from the initial weights (what a loader that drops the
    masters does) starts over at the first step's loss."""
    run = {**GPT, "lr": 0.01, "checkpoint_every": SAVED_AT}
    clean = dlab.launch("nd", 2, runs_dir=runs_dir, wait=True,
                        options={"dp": 2, "zero": 2, "precision": "bf16"}, **run)
    one = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, options={"precision": "bf16"},
                      resume=str(_step(clean, SAVED_AT).path), **run)
    want = losses(clean)
    tol = 2 * 2.0 ** -8 * abs(want[-1] - want[0])
    worst = max(abs(a - b) for a, b in zip(losses(one), want[SAVED_AT:], strict=True))
    assert worst <= tol, (losses(one), want[SAVED_AT:], worst, tol)
