"""Elastic membership: two torchrun agents (``--nnodes 1:2``) of 2 ranks each; one is SIGKILLed
mid-run and started again later (``dlab.procs.elastic.rehearse``).

What "the same training" means here: the global batch stays fixed, so every step applies the
batch an uninterrupted run applies, and the final parameters equal ``single``'s to fp32
summation order (1e-5); steps redone after a restart recompute the same batches from the
checkpoint (the data of step s is a function of s).
"""
from __future__ import annotations

import pytest
from helpers import TINY_GPT, final_state

from dlab.core.config import ConfigError
from dlab.procs.elastic import rehearse

#: a delay per step on rank 0 paces the run so the lost agent can come back before it ends
PACE = {"kind": "slow", "rank": 0, "step": 0, "steps": 1000, "delay_s": 0.2}
CONFIG = {**TINY_GPT, "steps": 40, "checkpoint_every": 2, "save_final": True}


@pytest.mark.slow  # 45 s; notebook 13 runs the same rehearsal under make test
def test_an_agent_lost_and_back_shrinks_grows_and_trains_the_same(runs_dir, reference):
    e = rehearse("ddp", lose_at=4, back_after=3, runs_dir=runs_dir, fault=PACE, **CONFIG)
    sizes = [w for w, _ in e.phases]
    assert sizes[-3:] == [4, 2, 4], e.phases  # (a first round may start at 2 and grow at once)
    assert e.phases[-2][1] >= 3, "it must have trained at 2 ranks before the agent came back"
    assert e.exit_codes == [0, 0], e.exit_codes
    assert e.redone_steps <= 2 * CONFIG["checkpoint_every"], e.redone_steps
    assert 0 < e.lost_s < 60 and 0 < e.back_s < 60, (e.lost_s, e.back_s)
    steps = [m["step"] for m in e.run.metrics(0)]
    assert steps == list(range(CONFIG["steps"])), "every step once, in order (redone ones kept once)"
    ref = final_state(reference(**{k: v for k, v in CONFIG.items() if k != "checkpoint_every"}))
    got = final_state(e.run)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


@pytest.mark.parametrize("kw, match", [
    ({"checkpoint_every": 0}, "checkpoint_every"),
    ({"batch_size": 6}, "batch_size"),
    ({"steps": 6}, "steps=6"),
    ({"agents": 1}, "at least 2 agents"),
    ({"fault": {"kind": "kill", "rank": 1, "step": 2}}, "drop resume and fault"),
])
def test_bad_rehearsals_are_refused_before_any_process(runs_dir, kw, match):
    config = {**CONFIG, **kw}
    with pytest.raises(ConfigError, match=match):
        rehearse("ddp", runs_dir=runs_dir, **config)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())
