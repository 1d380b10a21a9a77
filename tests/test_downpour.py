"""``ps-downpour``: every gradient applied as it lands (Dean et al. 2012).

Its update is not ``single``'s, so it is checked against its own rule: rank 0's metrics list
every gradient the server applied, in order, with the version of the weights it was computed
on; a one-process replay keeps every version of the weights, computes each listed gradient
(that rank's shard of that step's batch, on that version), divides it by N and steps the
optimizer. The replay must end where the run ends (1e-5). And a straggler must not hold the
fast ranks back: while it sleeps through its delay the others' gradients go on landing, so its
own arrive stale (a count, whatever the load: the delay is many times a loaded step); on an
idle machine (the slow test) their steps also stay far below its delay (but the last, which
waits for every gradient to be applied).
"""
from __future__ import annotations

import pytest
import torch
from helpers import TINY_GPT, assert_ranks_agree, final_state

import dlab
from dlab.core.config import RunConfig
from dlab.models import build
from dlab.models.data import make_data, shard

DELAY = 1.0  # s: ten loaded 4-rank steps of the tiny GPT (70-150 ms with a core busy)


def applied(run) -> list[list[int]]:
    return [a for m in run.metrics(0) for a in m["downpour"]["applied"]]


def replay(run) -> dict[str, torch.Tensor]:
    cfg = RunConfig.from_dict(run.config)
    model = build(cfg.model, cfg.model_options, cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    data = make_data(cfg)
    versions = [[p.detach().clone() for p in model.parameters()]]
    for rank, step, version, _ in applied(run):
        scratch = build(cfg.model, cfg.model_options, cfg.seed)
        with torch.no_grad():
            for p, v in zip(scratch.parameters(), versions[version]):
                p.copy_(v)
        x, y = shard(data.global_batch(step), rank, cfg.world_size)
        scratch.criterion(scratch(x), y).backward()
        for p, s in zip(model.parameters(), scratch.parameters()):
            p.grad = s.grad / cfg.world_size
        opt.step()
        versions.append([p.detach().clone() for p in model.parameters()])
    return {k: v.detach() for k, v in model.state_dict().items()}


def _straggling_downpour(runs_dir, steps=6):
    return dlab.launch("ps-downpour", 4, runs_dir=runs_dir, wait=True, save_final=True,
                       fault={"kind": "slow", "rank": 3, "step": 0, "delay_s": DELAY},
                       **{**TINY_GPT, "steps": steps})


def test_downpour_follows_its_rule_and_does_not_wait_for_a_straggler(runs_dir):
    steps = 6
    run = _straggling_downpour(runs_dir, steps)
    log = applied(run)
    assert sorted((r, t) for r, t, _, _ in log) == [(r, t) for r in range(4) for t in range(steps)]
    assert all(s == v2 - v for (_, _, v, s), v2 in zip(log, range(len(log)))), "staleness = V - v"
    assert max(s for r, _, _, s in log if r == 3) >= 2, "the straggler's gradients land stale"
    want, got = replay(run), final_state(run)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
    assert_ranks_agree(run)


@pytest.mark.slow
def test_the_fast_ranks_steps_stay_far_below_the_stragglers_delay(runs_dir):
    # but the last, where the server takes every outstanding push so that every replica ends equal
    run = _straggling_downpour(runs_dir)
    for r in range(3):
        assert max(m["step_time"] for m in run.metrics(r)[:-1]) < DELAY / 2, r
