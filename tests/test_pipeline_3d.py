"""3D parallelism: pipeline stages split by tensor parallelism, pipelines replicated by data
parallelism (``pipeline-*`` with options ``tp`` and ``dp``). It trains exactly like ``single``
(fp32 on Gloo, to 1e-5); every rank's parameters and bytes sent per step equal
``dlab.theory.nd``; impossible layouts are refused before any process starts."""
from __future__ import annotations

import pytest
from helpers import assert_same_training, losses

import dlab
from dlab.core.config import ConfigError
from dlab.layout import Layout
from dlab.models.gpt import GPTConfig
from dlab.theory import nd, tensor

GPT = {"model": "gpt", "batch_size": 8, "steps": 3, "optimizer": "sgd",  # SGD: helpers.py says why
       "model_options": {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 32}}

# gpipe and interleaved share 1f1b's executor and stage modules (their own schedules are checked
# in 2D by test_pipeline_parity.py): slow here, where 1f1b stands for them
# pp 2 x tp 2 with 1f1b is slow too: notebook 07 trains this very layout against single (and
# checks each rank's bytes against dlab.theory.nd) under make test
CASES = [pytest.param("1f1b", 4, {"tp": 2}, marks=pytest.mark.slow),  # pp 2 x tp 2
         pytest.param("gpipe", 4, {"tp": 2}, marks=pytest.mark.slow),
         pytest.param("interleaved", 4, {"tp": 2}, marks=pytest.mark.slow),  # 2 virtual stages
         pytest.param("1f1b", 8, {"tp": 2, "dp": 2}, marks=pytest.mark.slow)]  # dp 2 x pp 2 x tp 2: 3D


@pytest.mark.parametrize("schedule,world,options", CASES, ids=lambda c: str(c))
def test_3d_matches_single(schedule, world, options, runs_dir, reference):
    run = dlab.launch(f"pipeline-{schedule}", world, runs_dir=runs_dir, wait=True,
                      save_final=True, options=options, **GPT)
    assert_same_training(run, reference(**GPT))
    assert all(losses(run, r) == losses(run, 0) for r in range(world))
    if schedule == "interleaved":
        return  # a rank holds two stages: the byte count below is for one stage per rank
    cfg = GPTConfig(**GPT["model_options"])
    t, d = options["tp"], options.get("dp", 1)
    p = world // (t * d)
    lay = Layout(dp=d, pp=p, tp=t)
    for r in range(world):
        stage = r // (t * d)  # the mesh is row-major over (pp, dp, tp): nd's order
        want = nd.step_bytes(cfg, lay, GPT["batch_size"], stage)
        for m in run.metrics(r):
            assert m["comm"]["sent_bytes"] == pytest.approx(want["total"], rel=1e-12), (r, want)
            assert m["memory"]["parameters"] == nd.model_state(cfg, lay, stage)["parameters"]


@pytest.mark.parametrize("schedule,world,options,match", [
    ("1f1b", 4, {"tp": 3}, "does not divide world_size=4"),
    ("1f1b", 4, {"tp": 4}, "tp=4 must divide the model's 2 heads"),
    ("zbv", 4, {"tp": 2}, "tensor-parallel layers are not split"),
    ("1f1b", 4, {"tp": 0}, "tp must be a whole number >= 1"),
])
def test_bad_3d_layouts_are_refused_before_start(schedule, world, options, match, runs_dir):
    with pytest.raises(ConfigError, match=match):
        dlab.launch(f"pipeline-{schedule}", world, runs_dir=runs_dir, options=options, **GPT)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


@pytest.mark.parametrize("t,d", [(1, 2), (2, 1), (2, 2), (4, 1)])
def test_one_stage_is_tensor_parallelism_on_paper(t, d):
    """With p = 1 ``nd``'s formula is the TP x DP one of ``theory.tensor``, written apart."""
    opts = GPT["model_options"]
    got = nd.step_bytes(GPTConfig(**opts), Layout(dp=d, tp=t), 8, 0)
    assert got["total"] == pytest.approx(tensor.step_bytes(opts, 8, t, d, False)["total"], rel=1e-12)
    assert got["pipeline"] == got["tied"] == 0
