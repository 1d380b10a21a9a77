"""The ``cp`` strategy trains exactly like ``single`` (ring, all-gather, Ulysses and USP attention, zigzag and
contiguous layouts, 2 and 4 ranks, and CP x DP), sends per step what ``dlab.theory.context`` says, and
refuses a configuration it cannot split before any process starts."""
from __future__ import annotations

import pytest
from helpers import TINY_GPT, assert_same_training, losses

import dlab
from dlab.core.config import ConfigError
from dlab.models import model_config
from dlab.theory import context as est

CP_GPT = {**TINY_GPT, "model_options": {**TINY_GPT["model_options"], "seq_len": 32}}
PARAM_BYTES = 4 * model_config("gpt", CP_GPT["model_options"]).n_params()
# Ulysses splits the heads over the ranks: 4 heads, so that 4 ranks divide them
HEADS4 = {**CP_GPT, "model_options": {**CP_GPT["model_options"], "n_head": 4}}


# Slow: the ring over the contiguous layout (the same ring with other positions) and Ulysses
# (notebook 08 trains it against single under nbval); test_context_attention.py checks every
# attention on both layouts at 2 and 4 ranks by default.
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("attention,lay", [("ring", "zigzag"),
                                           pytest.param("ring", "contiguous", marks=pytest.mark.slow),
                                           ("allgather", "zigzag"),
                                           pytest.param("ulysses", "zigzag", marks=pytest.mark.slow),
                                           ("usp", "zigzag")])
def test_cp_trains_like_single_and_sends_the_formula_bytes(attention, lay, world_size, runs_dir,
                                                           reference):
    cfg = HEADS4 if attention == "ulysses" else CP_GPT
    run = dlab.launch("cp", world_size, runs_dir=runs_dir, wait=True, save_final=True,
                      options={"attention": attention, "layout": lay}, **cfg)
    assert_same_training(run, reference(**cfg))
    opts = cfg["model_options"]
    kv = est.kv_bytes(cfg["batch_size"], opts["seq_len"], opts["d_model"], world_size)
    want = est.sent_per_step(attention, world_size, opts["n_layer"], kv, PARAM_BYTES, ulysses=2)
    for rank in range(world_size):
        assert losses(run, rank) == losses(run, 0)
        assert all(m["comm"]["sent_bytes"] == want for m in run.metrics(rank))


def test_cp_times_dp_trains_like_single(runs_dir, reference):
    """4 ranks as 2 data-parallel replicas of 2 context-parallel ranks each."""
    run = dlab.launch("cp", 4, runs_dir=runs_dir, wait=True, save_final=True,
                      options={"cp": 2}, **CP_GPT)
    assert_same_training(run, reference(**CP_GPT))
    opts = CP_GPT["model_options"]
    kv = est.kv_bytes(CP_GPT["batch_size"] // 2, opts["seq_len"], opts["d_model"], 2)
    want = est.sent_per_step("ring", 2, opts["n_layer"], kv, PARAM_BYTES, world=4)
    for rank in range(4):
        assert all(m["comm"]["sent_bytes"] == want for m in run.metrics(rank))


def test_cp_refuses_what_cannot_be_split(runs_dir):
    with pytest.raises(ConfigError, match="seq_len=30 does not cut into 8 equal chunks"):
        dlab.launch("cp", 4, runs_dir=runs_dir,
                    model_options={**TINY_GPT["model_options"], "seq_len": 30})
    with pytest.raises(ConfigError, match="option attention='flash' is not one of"):
        dlab.launch("cp", 2, runs_dir=runs_dir, options={"attention": "flash"})
    with pytest.raises(ConfigError, match="cp=3 takes 3 ranks, which does not divide world_size=4"):
        dlab.launch("cp", 4, runs_dir=runs_dir, options={"cp": 3})
    with pytest.raises(ConfigError, match="n_head=2 is not a multiple of cp=4"):
        dlab.launch("cp", 4, runs_dir=runs_dir, options={"attention": "ulysses"}, **CP_GPT)
    with pytest.raises(ConfigError, match="option ulysses=3 must divide cp=4"):
        dlab.launch("cp", 4, runs_dir=runs_dir, options={"attention": "usp", "ulysses": 3}, **CP_GPT)
    with pytest.raises(ConfigError, match="n_head=2 is not a multiple of ulysses=4"):
        dlab.launch("cp", 4, runs_dir=runs_dir, options={"attention": "usp", "ulysses": 4}, **CP_GPT)
    with pytest.raises(ConfigError, match="use model='gpt'"):
        dlab.launch("cp", 2, runs_dir=runs_dir, model="mlp")
