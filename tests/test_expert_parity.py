"""The ``ep`` strategy trains the ``moe`` model exactly like ``single`` at 2 and 4 ranks (top-1
and top-2 routing), holds the dense part and 1/n of the experts per rank, and refuses what it
cannot split before any process starts."""
from __future__ import annotations

import pytest
from helpers import TINY_GPT, assert_same_training, losses

import dlab
from dlab.core.config import ConfigError
from dlab.models import model_config

N_EXPERT = 4


def moe(k: int) -> dict:
    return {**TINY_GPT, "model": "moe",
            "model_options": {**TINY_GPT["model_options"], "n_expert": N_EXPERT, "top_k": k}}


# top-2 routing sends each token to two experts and weighs them: it runs top-1's dispatch and
# more, so it stands for both in the default run (top-1 is slow); test_expert_dispatch.py
# checks the layer at k = 1 and 2 on 2 and 4 ranks by default
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_ep_trains_like_single_with_a_share_of_the_experts(k, world_size, runs_dir, reference):
    config = moe(k)
    run = dlab.launch("ep", world_size, runs_dir=runs_dir, wait=True, save_final=True, **config)
    assert_same_training(run, reference(**config))
    mc = model_config("moe", config["model_options"])
    experts = mc.n_layer * mc.n_expert * mc.mlp_params()
    held = mc.n_params() - experts + experts // world_size
    for rank in range(world_size):
        assert losses(run, rank) == losses(run, 0)
        assert run.metrics(rank)[-1]["memory"]["parameters"] == 4 * held


def test_ep_refuses_what_cannot_be_split(runs_dir):
    with pytest.raises(ConfigError, match="n_expert=6 does not split over ep=4"):
        dlab.launch("ep", 4, runs_dir=runs_dir, model="moe", model_options={"n_expert": 6})
    with pytest.raises(ConfigError, match="use model='moe'"):
        dlab.launch("ep", 2, runs_dir=runs_dir)
    with pytest.raises(ConfigError, match="top_k=3 must be between 1 and n_expert=2"):
        dlab.launch("ep", 2, runs_dir=runs_dir, model="moe",
                    model_options={"n_expert": 2, "top_k": 3})
