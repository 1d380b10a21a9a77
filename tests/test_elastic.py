"""Elastic membership: two torchrun agents (``--nnodes 1:2``) of 2 ranks each; one is SIGKILLed
mid-run and started again later (``dlab.procs.elastic.rehearse``).

What "the same training" means here: the global batch stays fixed, so every step applies the
batch an uninterrupted run applies, and the final parameters equal ``single``'s to fp32
summation order (1e-5); steps redone after a restart recompute the same batches from the
checkpoint (the data of step s is a function of s).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import TINY_GPT, assert_ranks_agree, final_state

import dlab
from dlab.core.config import ConfigError, RunConfig
from dlab.core.rundir import JsonlTail, RunDir
from dlab.procs.elastic import rehearse
from dlab.procs.process import free_port

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
    for r in range(e.run.world_size):  # every rank of the final size, not rank 0's only
        got = final_state(e.run, r)
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5, r
    assert_ranks_agree(e.run)


@pytest.mark.slow  # 127 s under load; tests/test_nd_checkpoint.py reshards nd by default
def test_nd_loses_an_agent_and_reshards_its_layout(runs_dir, reference):
    """``nd`` with tp2 x ZeRO-2 over what dp the world leaves: 4 ranks (dp2 x tp2), then 2 (dp1
    x tp2) after an agent is lost, then 4 again; each restart cuts its pieces out of the
    newest checkpoint at the new layout, and the run ends as ``single`` does (1e-5, every
    rank)."""
    config = {**CONFIG, "options": {"tp": 2, "zero": 2}, "fault": PACE}
    e = rehearse("nd", lose_at=2, back_after=2, runs_dir=runs_dir, **config)
    assert [w for w, _ in e.phases][-3:] == [4, 2, 4], e.phases
    assert e.exit_codes == [0, 0], e.exit_codes
    ref = final_state(reference(**{k: v for k, v in config.items()
                                   if k not in ("checkpoint_every", "options", "fault")}))
    for r in range(e.run.world_size):
        got = final_state(e.run, r)
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5, r


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


def start_with(configs: list[dict], steps: list[int]) -> str:
    """Code for each rank of a spawn: the worker's agreement before training, on this rank's
    config and first step (code, not a function: a rank cannot import this test module)."""
    return ("import json\nfrom dlab.worker.main import agree_on_config, agree_on_step\n"
            f"agree_on_config(json.loads({json.dumps(json.dumps(configs))})[rank])\n"
            f"agree_on_step({steps}[rank])\n")


def test_ranks_that_disagree_on_the_config_or_the_step_do_not_train_together(runs_dir):
    base = RunConfig(strategy="ddp", world_size=2, **TINY_GPT).to_dict()
    # rank 1 asks to resume in another way (allowed: the steps are compared) and has another lr
    with pytest.raises(dlab.RunFailed, match=r"RanksDisagree(.|\n)*rank 1 has lr=0\.5 where rank 0 "
                                             rf"has lr={base['lr']}\n") as info:
        dlab.spawn(start_with([base, {**base, "lr": 0.5, "resume": "latest"}], [0, 0]), 2,
                   runs_dir=runs_dir)
    assert "resume" not in str(info.value).split("traceback")[0]
    with pytest.raises(dlab.RunFailed, match=r"ranks \[1\] at step 0; ranks \[0\] at step 4"):
        dlab.spawn(start_with([base, base], [4, 0]), 2, runs_dir=runs_dir)


def _torchrun_worker(run_dir, *flags) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           f"--log-dir={run_dir / 'torchelastic'}", "-m", "dlab.worker", "--run-dir",
           str(run_dir), "--elastic", "ddp", "--batch-size", "8", "--optimizer", "sgd",
           "--checkpoint-every", "2", *(f"--model-opt={k}={v}" for k, v in
                                        TINY_GPT["model_options"].items()), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_an_elastic_worker_started_with_flags_resumes_as_with_a_config(tmp_path):
    """``--elastic`` with flags instead of ``--config``: every start resumes from the run's
    newest checkpoint (a returning agent's ranks started from step 0 while the others resumed)."""
    run_dir = tmp_path / "run"
    first = _torchrun_worker(run_dir, "--steps", "4")
    assert first.returncode == 0, first.stdout[-2000:]
    again = _torchrun_worker(run_dir, "--steps", "6")
    assert again.returncode == 0, again.stdout[-2000:]
    records = JsonlTail(RunDir(run_dir).metrics_file(1)).read()
    assert [m["step"] for m in records] == [0, 1, 2, 3, 4, 5], "steps 0-3 must not run again"
