"""MoE as trained: capacity with dropped tokens, the load-balancing and router z-losses, and
the routing each run records; ``ep`` against ``single`` with every option (the same drops, the
same losses and parameters), and the options refused where they are not built."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_GPT, assert_same_training

import dlab
from dlab.analysis.moe import experts_seconds, rank_rows
from dlab.core.config import ConfigError
from dlab.models import moe
from dlab.models.moe import MoE, MoEConfig, drop_over_capacity


def _queue_rule(experts: list[list[int]], group: int, limit: int) -> list[list[int]]:
    """The rule as GShard states it, one assignment at a time: in each group, every token's
    first choice in order, then every second choice; an expert past ``limit`` drops the rest."""
    out = [row[:] for row in experts]
    for start in range(0, len(experts), group):
        taken: dict[int, int] = {}
        for slot in range(len(experts[0])):
            for t in range(start, start + group):
                e = experts[t][slot]
                taken[e] = taken.get(e, 0) + 1
                if taken[e] > limit:
                    out[t][slot] = -1
    return out


def test_capacity_keeps_first_choices_first_then_position():
    torch.manual_seed(0)
    experts = torch.stack([torch.randperm(4)[:2] for _ in range(12)])  # 12 tokens, top-2 of 4
    for group, limit in ((4, 1), (6, 2), (12, 3), (12, 6)):
        got = drop_over_capacity(experts, group, limit).tolist()
        assert got == _queue_rule(experts.tolist(), group, limit), (group, limit)
    assert moe.capacity(1.25, 32, 2, 4) == 20 and moe.capacity(1.0, 30, 1, 4) == 8


def _layer(**options) -> MoE:
    torch.manual_seed(1)
    layer = MoE(MoEConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, n_expert=4, top_k=2, **options))
    torch.nn.init.normal_(layer.router.weight, std=0.5)  # uneven routing
    return layer


def test_dropped_tokens_are_counted_and_pass_through_as_zero():
    x = torch.randn(3, 8, 16)
    full = _layer()(x)
    tight = _layer(capacity_factor=0.5)
    out = tight(x)
    routed, dropped = tight.routed, tight.dropped
    assert routed.sum() == 3 * 8 * 2 and dropped.sum() > 0
    kept_per_group = moe.capacity(0.5, 8, 2, 4)  # per expert and sequence
    assert ((routed - dropped) <= 3 * kept_per_group).all()
    # a token with every assignment dropped gets no MLP output at all
    chosen = F.softmax(tight.router(x.reshape(-1, 16)), -1).topk(2, -1).indices
    experts = drop_over_capacity(chosen, 8, kept_per_group)
    gone = (experts < 0).all(dim=1)
    assert torch.equal(out.reshape(-1, 16)[gone], torch.zeros(int(gone.sum()), 16))
    roomy = _layer(capacity_factor=4.0)  # capacity = every assignment of the group
    assert torch.allclose(roomy(x), full) and roomy.dropped.sum() == 0


def test_auxiliary_losses_follow_switch_and_st_moe():
    x = torch.randn(2, 8, 16)
    layer = _layer(aux_loss=0.01, z_loss=0.001)
    layer(x)
    logits = layer.router(x.reshape(-1, 16)).detach()
    probs = logits.softmax(-1)
    top2 = probs.topk(2, -1).indices.tolist()
    tokens = len(top2)
    switch = 0.0
    for e in range(4):  # E * sum_e (share of the 2 * tokens assignments) * (mean probability)
        share = sum(row.count(e) for row in top2) / (2 * tokens)
        switch += share * probs[:, e].mean().item()
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / tokens
    assert layer.aux.item() == pytest.approx(0.01 * 4 * switch + 0.001 * z, rel=1e-5)


def _moe(**options) -> dict:
    return {**TINY_GPT, "model": "moe",
            "model_options": {**TINY_GPT["model_options"], "n_expert": 4, "top_k": 2, **options}}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("options", [{"aux_loss": 0.1, "z_loss": 0.01}, {"capacity_factor": 1.0}],
                         ids=["losses", "capacity"])
def test_ep_trains_like_single_with_each_option(options, world_size, runs_dir, reference):
    config = _moe(**options)
    run = dlab.launch("ep", world_size, runs_dir=runs_dir, wait=True, save_final=True, **config)
    ref = reference(**config)
    assert_same_training(run, ref)
    for step, want in enumerate(ref.metrics(0)):  # the same drops, counted on the ranks
        for what in ("routed", "dropped"):
            got = [[sum(c) for c in zip(*(run.metrics(r)[step]["moe"][what][layer]
                                          for r in range(world_size)))]
                   for layer in range(len(want["moe"][what]))]
            assert got == want["moe"][what], (step, what)
    if "capacity_factor" in options:
        assert sum(map(sum, ref.metrics(0)[-1]["moe"]["dropped"])) > 0  # the option bites
    # the rows each rank's experts computed (what bench expert's busiest-rank model reads) add
    # up to the whole batch's kept assignments, and every rank timed its experts every step
    for step, want in enumerate(ref.metrics(0)):
        kept = sum(map(sum, want["moe"]["routed"])) - sum(map(sum, want["moe"]["dropped"]))
        n_expert = config["model_options"]["n_expert"]
        assert sum(rank_rows(run, world_size, n_expert, step)) == kept
    for r in range(world_size):
        assert set(experts_seconds(run, r)) == set(range(config["steps"])), r


def test_moe_training_options_are_refused_where_not_built(runs_dir):
    with pytest.raises(ConfigError, match="aux_loss are built for ep and single"):
        dlab.launch("ddp", 2, runs_dir=runs_dir, **_moe(aux_loss=0.1))
    with pytest.raises(ConfigError, match="capacity_factor=-1 must be >= 0"):
        dlab.launch("ep", 2, runs_dir=runs_dir, **_moe(capacity_factor=-1))
