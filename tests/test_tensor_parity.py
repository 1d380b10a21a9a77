"""Tensor parallelism (with and without sequence parallelism) and TP x DP train exactly like the
single-process reference; the bytes each step moves equal the formula; bad configs are refused.

SGD, not Adam: Adam divides by the root of the squared gradient, so for a weight whose gradient
is ~1e-8 a rounding difference in the last bits (the sums run in another order across ranks)
becomes a visible difference in its update. With SGD the parameters agree to 1e-6 (fp32)."""
from __future__ import annotations

import pytest
from helpers import assert_same_training, losses

import dlab
from dlab.estimate.tensor import activation_bytes, local_params, step_bytes
from dlab.models.gpt import GPTConfig

# n_head=4 so the heads split over tp=4; d_ff=128, vocab 256 and seq_len 32 divide by 4 too.
TP_GPT = {"model": "gpt", "batch_size": 8, "steps": 3, "optimizer": "sgd",
          "model_options": {"n_layer": 2, "d_model": 32, "n_head": 4, "seq_len": 32}}

CASES = [  # (world_size, options)
    (2, {"tp": 2}),
    (2, {"tp": 2, "sequence_parallel": True}),
    (4, {"tp": 4}),
    (4, {"tp": 4, "sequence_parallel": True}),
    (4, {"tp": 2}),  # TP x DP, 2 x 2
    (4, {"tp": 2, "sequence_parallel": True}),
]


@pytest.mark.parametrize("world_size,options", CASES, ids=lambda c: str(c))
def test_tp_matches_single(world_size, options, runs_dir, reference):
    run = dlab.launch("tp", world_size, runs_dir=runs_dir, wait=True, save_final=True,
                      options=options, **TP_GPT)
    assert_same_training(run, reference(**TP_GPT), loss_tol=1e-5, param_tol=1e-6)
    assert all(losses(run, r) == losses(run, 0) for r in range(world_size))
    # bytes moved per step, measured by the counting Comm, equal the formula on every rank
    tp, sp = options["tp"], options.get("sequence_parallel", False)
    want = step_bytes(TP_GPT["model_options"], TP_GPT["batch_size"], tp, world_size // tp, sp)
    # and the activations each rank saved for backward equal the count in dlab.estimate
    saved = activation_bytes(TP_GPT["model_options"], TP_GPT["batch_size"] // (world_size // tp),
                             tp, sp)["total"]
    for r in range(world_size):
        for m in run.metrics(r):
            assert m["comm"]["sent_bytes"] == pytest.approx(want["total"], rel=1e-12)
            assert m["memory"]["activations"] == saved


@pytest.mark.parametrize("world_size,options", [(2, {"tp": 2}),
                                                pytest.param(4, {"tp": 4}, marks=pytest.mark.slow),
                                                (4, {"tp": 2, "sequence_parallel": True})],
                         ids=lambda c: str(c))
def test_torch_tp_peer_matches_single(world_size, options, runs_dir, reference):
    """The peer the benchmark compares against trains the same model to the same numbers, and
    splits it as ``tp`` does, the vocabulary included: every rank holds the parameters
    ``dlab.estimate.tensor`` counts for a tensor-parallel rank (the token embedding's V/t rows,
    tied to the head), not a replicated embedding and head."""
    run = dlab.launch("torch-tp", world_size, runs_dir=runs_dir, wait=True, save_final=True,
                      options=options, **TP_GPT)
    assert_same_training(run, reference(**TP_GPT), loss_tol=1e-5, param_tol=1e-6)
    held = local_params(GPTConfig(**TP_GPT["model_options"]), options["tp"])
    for r in range(world_size):
        assert run.metrics(r)[-1]["memory"]["parameters"] == 4 * held, r
