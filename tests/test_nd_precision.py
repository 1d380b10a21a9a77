"""``nd`` in mixed precision: every layout trains like ``single`` in the same precision, and every
rank holds the model-state bytes ``estimate.nd.model_state`` gives for that precision.

The tolerance, derived. ``single`` and ``nd`` compute in the same dtype on the same numbers but
sum them in another order (a gradient summed over data ranks, a tensor-parallel partial sum,
micro-batches accumulated, a ring attention's blocks), and each sum in bf16 rounds to its unit
roundoff u = 2^-8 (fp16: 2^-11) relative. The fp32 masters then move by the SGD update, a
linear function of the gradients (momentum 0.9 weighs the three steps' gradients 2.71, 1.9, 1),
so a relative error of a few roundings in the gradients is the same relative error in each
master's total movement. The test holds every rank's final parameters to 2u (two roundings) of
the largest total movement of the reference's parameters, and the losses to 2u of the
reference's decrease over the run. Measured (4 ranks, bf16: pp2 x tp2+sp, dp2 zero3 x tp2,
cp2 x tp2+sp zero2, MoE dp2 x ep2 x tp2+sp): at most 1.3u of the movement (parameters) and 0.3u
of the decrease (losses), so 2u leaves a margin of 1.5; a gradient off by a factor
(a missing /N, an unreduced tied matrix, masters not refreshed) moves parameters by about
their whole movement, u^-1 = 256 times the tolerance.
"""
from __future__ import annotations

import pytest
import torch
from helpers import assert_ranks_agree, final_state, losses
from test_nd_parity import GPT, MOE, SP

import dlab
from dlab import models, parallel
from dlab.core.config import ConfigError, RunConfig
from dlab.core.precision import PRECISIONS
from dlab.layout import Layout
from dlab.theory import nd
from dlab.theory.memory import model_units, padded

#: the unit roundoff of each compute dtype: 2^-(mantissa bits + 1)
ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def check(world, config, options, precision, runs_dir, reference):
    """Parity with ``single`` in ``precision`` to the tolerance derived above, every rank; the
    ranks' gathered fp32 masters equal bit for bit; each rank's parameters, gradients and
    optimizer state equal to the estimate for the precision, and its activation peak to 2 % as
    in fp32 (``test_nd_parity.check``; a MoE's from the step's recorded routing)."""
    run = dlab.launch("nd", world, runs_dir=runs_dir, wait=True, save_final=True,
                      options={**options, "precision": precision}, **config)
    ref = reference(**{**config, "options": {"precision": precision}})
    u = ROUNDOFF[PRECISIONS[precision].compute]
    got, want = losses(run), losses(ref)
    assert len(got) == len(want) == config["steps"]
    decrease = abs(want[-1] - want[0])
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= 2 * u * decrease, (got, want, worst / u)
    init = models.build(config["model"], config["model_options"], run.config["seed"]).state_dict()
    theirs = final_state(ref)
    movement = max((theirs[k] - init[k]).abs().max().item() for k in theirs)
    for r in range(world):
        mine = final_state(run, r)
        assert mine.keys() == theirs.keys()
        assert all(t.dtype == torch.float32 for t in mine.values()), r  # the masters
        diff = max((mine[k] - theirs[k]).abs().max().item() for k in theirs)
        assert diff <= 2 * u * movement, (r, diff / u, movement)
    assert_ranks_agree(run)
    ref_state = parallel.get("single").predicted_state(RunConfig.from_dict(ref.config), 0)
    assert {k: ref.metrics(0)[-1]["memory"][k] for k in ref_state} == ref_state  # the reference's
    cfg = RunConfig.from_dict(run.config)
    lay = Layout.from_options(cfg.options, world)
    for r in range(world):
        pp_rank = r // (world // lay.pp)
        want_state = nd.model_state(cfg.model_config(), lay, pp_rank, cfg.optimizer, precision)
        for m in run.metrics(r):
            assert {k: m["memory"][k] for k in want_state} == want_state, r
            routing = m["expert_rows"]["calls"] if lay.ep > 1 else None
            held = nd.activations(cfg.model_config(), lay, cfg.batch_size, pp_rank, precision,
                                  routing)["peak"]
            assert m["memory"]["activations"] == pytest.approx(held, rel=0.02), (r, held)
    return run


@pytest.mark.parametrize("world,options,precision", [
    (2, {"dp": 2, "zero": 1}, "bf16"),
    (2, {"pp": 2}, "bf16-fp32-grads"),  # masters per parameter, the tied matrix's fp32 gradient
    (2, {"dp": 2, "zero": 3}, "fp16"),  # the loss scaler
], ids=str)
def test_mixed_precision_trains_like_single_in_that_precision(world, options, precision, runs_dir,
                                                              reference):
    check(world, GPT, options, precision, runs_dir, reference)


# Each dimension at least once (pp, dp, tp with and without sp, cp, ep), ZeRO 0-3, the three
# precisions, at 4 and 8 ranks
GRID = [
    (4, GPT, {"pp": 2, "tp": 2, **SP}, "bf16"),
    (4, GPT, {"dp": 2, "zero": 3, "tp": 2}, "bf16"),
    (4, GPT, {"cp": 2, "tp": 2, "zero": 2, **SP}, "bf16-fp32-grads"),
    (4, MOE, {"dp": 2, "ep": 2, "tp": 2, **SP}, "bf16"),
    (4, GPT, {"dp": 2, "zero": 1, "pp": 2, "schedule": "zbv"}, "bf16-fp32-grads"),
    (8, GPT, {"dp": 2, "zero": 3, "pp": 2, "tp": 2}, "bf16"),
    (8, GPT, {"pp": 2, "tp": 2, "cp": 2, **SP}, "bf16"),
    (8, GPT, {"dp": 2, "zero": 1, "pp": 2, "cp": 2, "attention": "allgather"}, "bf16-fp32-grads"),
    (8, MOE, {"dp": 2, "cp": 2, "ep": 4, "tp": 2, "zero": 2, **SP}, "bf16"),
    (4, GPT, {"dp": 2, "zero": 2, "tp": 2}, "fp16"),
]


@pytest.mark.slow
@pytest.mark.parametrize("n,config,options,precision", GRID,
                         ids=[f"{c[1]['model']}-{c[0]}-{c[3]}-" + "-".join(f"{k}{v}" for k, v in c[2].items())
                              for c in GRID])
def test_mixed_precision_grid(n, config, options, precision, runs_dir, reference):
    check(n, config, options, precision, runs_dir, reference)


@pytest.mark.parametrize("precision,w,g", [("bf16", 2, 2), ("bf16-fp32-grads", 2, 4)])
def test_adam_bytes_are_the_zero_papers(precision, w, g, runs_dir):
    """2 + 2 + 12 (bf16) and 2 + 4 + 12 (bf16-fp32-grads) bytes per parameter with Adam, as the
    ZeRO paper counts them, under ZeRO-1 over 2 ranks: weights whole, gradients whole plus the
    reduced shard, the fp32 master and two moments (12 bytes) of the owned half, and Adam's
    4-byte step counter per unit. The units are ``estimate.memory.model_units``', the ZeRO
    strategies' accounting, not ``estimate.nd``'s."""
    run = dlab.launch("nd", 2, runs_dir=runs_dir, wait=True,
                      options={"dp": 2, "zero": 1, "precision": precision},
                      **{**GPT, "optimizer": "adam", "steps": 1})
    units = model_units("gpt", GPT["model_options"]).all
    full = sum(padded(u, 2) for u in units)
    for r in range(2):
        mem = run.metrics(r)[-1]["memory"]
        assert mem["parameters"] == w * full
        assert mem["gradients"] == g * (full + full // 2)
        assert mem["optimizer"] == 12 * full // 2 + 4 * len(units)


@pytest.mark.parametrize("strategy,options,match", [
    ("nd", {"dp": 2, "precision": "bf32"}, "is not one of"),
    ("single", {"precision": "fp8"}, "is not one of"),
])
def test_unknown_precisions_are_refused_before_start(strategy, options, match, runs_dir):
    with pytest.raises(ConfigError, match=match):
        dlab.launch(strategy, 2 if strategy == "nd" else 1, runs_dir=runs_dir, options=options, **GPT)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())
