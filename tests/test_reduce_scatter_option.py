"""``reduce_scatter="ring"``: ZeRO's gradient reduce-scatter and sequence parallelism's
reduce-scatters by dlab's own ring instead of Gloo's (a whole all-reduce). Training is
unchanged (parity with ``single``), and the bytes measured on the wire per step are the ring's
with the option and Gloo's without, exactly."""
from __future__ import annotations

import pytest
from helpers import assert_same_training, losses

import dlab
from dlab.comm import gloo as model
from dlab.core.config import ConfigError, RunConfig
from dlab.theory.memory import model_units, zero_wire_bytes
from dlab.worker.validate import validate

# Plain SGD, as every parity test (tests/helpers.py: Adam hides a gradient off by a factor)
UNEVEN = {"model": "gpt", "batch_size": 8, "steps": 3, "optimizer": "sgd",
          "model_options": {"n_layer": 3, "d_model": 31, "n_head": 1, "seq_len": 32}}
TP_GPT = {"model": "gpt", "batch_size": 8, "steps": 3, "optimizer": "sgd",
          "model_options": {"n_layer": 2, "d_model": 32, "n_head": 4, "seq_len": 32}}
STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}


def step_wire(run, rank: int) -> list[tuple[int, int]]:
    """Per step: (wire bytes of the strategy's Comm ops, the step's logged-loss all-reduce)."""
    out = []
    for m in run.metrics(rank):
        ops = {op: d["wire_bytes"] for op, d in m["comm_by_op"].items()}
        outside = ops.pop("outside_comm")
        assert m["comm"]["wire_bytes"] == sum(ops.values()) + outside
        out.append((sum(ops.values()), outside))
    return out


# 2-rank cases in the default run; the 4-rank ones are slow (make test-slow). ZeRO-2 and ZeRO-3
# reduce-scatter their gradients through the same code (zero3 is a GradientSharding, zero2's
# class): zero3 stands for both with the ring, and zero2's 2-rank ring case is slow too
@pytest.mark.parametrize("strategy,n,algorithm", [
    pytest.param("zero2", 2, "ring", marks=pytest.mark.slow),
    pytest.param("zero2", 4, "ring", marks=pytest.mark.slow),
    ("zero3", 2, "ring"), pytest.param("zero3", 4, "ring", marks=pytest.mark.slow),
    pytest.param("zero2", 4, "backend", marks=pytest.mark.slow),
    pytest.param("zero3", 2, "backend", marks=pytest.mark.slow),  # the default: tests/test_zero.py
])
def test_zero_reduce_scatter_option(strategy, n, algorithm, runs_dir, reference):
    run = dlab.launch(strategy, n, runs_dir=runs_dir, wait=True, save_final=True,
                      options={"reduce_scatter": algorithm}, **UNEVEN)
    assert_same_training(run, reference(**UNEVEN))
    assert all(losses(run, r) == losses(run, 0) for r in range(n))
    units = model_units("gpt", UNEVEN["model_options"])
    for r in range(n):
        want = zero_wire_bytes(units, n, r, STAGE[strategy], algorithm)
        for ops, outside in step_wire(run, r):
            assert ops == want, f"rank {r}: measured {ops} B, model of Gloo {want} B"
            assert outside == model.gloo_all_reduce_bytes(4, n, r)  # mean_loss's one float


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sequence_parallel_reduce_scatter_option(n, runs_dir, reference):
    wire = {}
    for algorithm in ("ring", "backend"):
        run = dlab.launch("tp", n, runs_dir=runs_dir, wait=True, save_final=True,
                          options={"tp": n, "sequence_parallel": True, "reduce_scatter": algorithm},
                          **TP_GPT)
        assert_same_training(run, reference(**TP_GPT), loss_tol=1e-5, param_tol=1e-6)
        for r in range(n):
            for m in run.metrics(r):
                rs = m["comm_by_op"]["reduce_scatter"]
                assert rs["wire_bytes"] == rs["gloo_bytes"], (algorithm, r, rs)
                for op, d in m["comm_by_op"].items():
                    if op != "outside_comm":
                        assert d["wire_bytes"] == d["gloo_bytes"], (algorithm, r, op, d)
        wire[algorithm] = run.metrics(0)[-1]["comm_by_op"]["reduce_scatter"]
    ring, backend = wire["ring"], wire["backend"]
    assert ring["sent_bytes"] == backend["sent_bytes"]  # the ring model cannot tell them apart
    assert ring["wire_bytes"] < backend["wire_bytes"]  # the wire can


def test_bad_reduce_scatter_option_is_refused():
    for strategy in ("zero2", "tp", "cp"):
        with pytest.raises(ConfigError, match="reduce_scatter"):
            validate(RunConfig(strategy=strategy, world_size=2, model="gpt",
                      options={"reduce_scatter": "tree"}))


CP_GPT = {"model": "gpt", "batch_size": 8, "steps": 4, "optimizer": "sgd",
          "model_options": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32}}


# slow: dlab's ring reduce-scatter runs by default under sequence parallelism and zero3 above
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_context_parallel_allgather_reduce_scatter_option(n, runs_dir, reference):
    """The all-gather attention's backward reduce-scatter by dlab's ring: same training, and its
    measured bytes are the ring's."""
    run = dlab.launch("cp", n, runs_dir=runs_dir, wait=True, save_final=True,
                      options={"attention": "allgather", "reduce_scatter": "ring"}, **CP_GPT)
    assert_same_training(run, reference(**CP_GPT))
    layers = CP_GPT["model_options"]["n_layer"]
    for r in range(n):
        for m in run.metrics(r):
            rs = m["comm_by_op"]["reduce_scatter"]
            assert rs["calls"] == layers
            assert rs["wire_bytes"] == rs["gloo_bytes"], (r, rs)
            # each call reduce-scatters the layer's gathered K/V gradient: S = n x 2 b h t/n d x 4
            s = rs["payload_bytes"] // layers
            assert rs["wire_bytes"] == layers * model.ring_reduce_scatter_wire(s, n)
