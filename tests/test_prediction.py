"""A run beside its prediction (``dlab.analysis.prediction``): the planner's figures for the
run's own layout and machine, held to what the run measured: its memory and bytes exactly, its
step time as a model of a shared CPU (within a factor, the range stated)."""
from __future__ import annotations

import pytest

import dlab
from dlab.analysis.prediction import predict_run
from tests.helpers import TINY_GPT


@pytest.mark.parametrize("strategy,options", [("nd", {"dp": 2, "zero": 1}), ("ddp", {})])
def test_a_runs_prediction_holds_its_memory_and_bytes_and_brackets_its_step(strategy, options, runs_dir):
    run = dlab.launch(strategy, 2, runs_dir=runs_dir, wait=True, **{**TINY_GPT, "steps": 3},
                      options=options)
    pred = predict_run(run.config)  # the run's config.json, as the summary reads it
    assert pred is not None and "not a measurement" in pred["model"]
    last = [run.metrics(r)[-1] for r in range(2)]
    for key in ("parameters", "gradients", "optimizer"):
        assert pred["memory_bytes"][key] == max(m["memory"][key] for m in last), key
    assert pred["sent_bytes"]["total"] == pytest.approx(max(m["comm"]["sent_bytes"] for m in last), abs=1)
    measured = min(m["step_time"] for m in last)
    assert pred["step_low_s"] <= pred["step_s"] <= pred["step_high_s"]
    # a model of a shared CPU, calibrated apart: a tiny model's step is mostly the lab's own
    # bookkeeping, which the planner leaves out (docs/RESULTS.md), so only its order is held
    assert 0.1 < pred["step_s"] / measured < 10


def test_what_the_planner_cannot_model_is_none():
    base = {"strategy": "ps-async", "world_size": 2, **TINY_GPT}
    assert predict_run(base) is None
    assert predict_run({**base, "strategy": "ddp", "model": "mlp", "model_options": {}}) is None
    assert predict_run({**base, "strategy": "ddp"}) is not None
