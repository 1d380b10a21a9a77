"""``python -m dlab check``: its plan per machine, its comparison, and the command itself in quick
mode on this CPU machine (what CI can run of the GPU check)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dlab.tools import check


def test_plan_follows_the_gpus_there_are():
    none = check.plan(["ddp"], gpus=0, quick=False)
    assert [(c.world_size, c.backend, c.device) for c in none] == [(2, "gloo", "cpu"), (4, "gloo", "cpu")]
    one = check.plan(["ddp"], gpus=1, quick=True)
    assert [(c.world_size, c.backend, c.device) for c in one] == [(1, "nccl", "cuda"), (2, "gloo", "cuda")]
    two = check.plan(["ddp"], gpus=2, quick=False)
    assert [(c.world_size, c.backend) for c in two] == [(2, "nccl")]  # 4 ranks need 4 GPUs
    assert check.plan(["ps-async"], 0, True)[0].options == {"max_staleness": 0}


def test_compare_sees_a_changed_parameter_a_missing_one_and_a_missing_step():
    state = {"w": torch.ones(3), "b": torch.zeros(2)}
    same = check.compare(state, {k: v.clone() for k, v in state.items()}, [1.0, 0.5], [1.0, 0.5])
    assert same == {"loss_diff": 0.0, "param_diff": 0.0}
    moved = {"w": torch.tensor([1.0, 1.0, 1.003]), "b": torch.zeros(2)}
    assert abs(check.compare(moved, state, [1.0], [1.0])["param_diff"] - 3e-3) < 1e-6
    assert check.compare({"w": state["w"]}, state, [1.0], [1.0])["param_diff"] == float("inf")
    assert check.compare(state, state, [1.0], [1.0, 0.5])["loss_diff"] == float("inf")


def test_failures_are_told_apart_from_what_gloo_cannot_do_on_cuda():
    gloo_cuda, nccl = check.Case("zero2", 2, "gloo", "cuda"), check.Case("zero2", 1, "nccl", "cuda")
    missing = RuntimeError("rank 0 of 2 failed: RuntimeError: unsupported device type cuda\n...")
    assert check.failure(gloo_cuda, missing)["result"] == "skipped"
    assert "unsupported device type" in check.failure(gloo_cuda, missing)["why"]
    assert check.failure(nccl, missing)["result"] == "FAIL"  # NCCL supports every op: a real failure
    assert check.failure(gloo_cuda, RuntimeError("loss is nan"))["result"] == "FAIL"


def test_a_case_its_layout_cannot_run_is_a_skipped_row_not_a_stopped_check(monkeypatch, tmp_path):
    """On one GPU the plan sets every strategy at one rank; nd's check layout needs pp = 2. That
    case is refused as launch would refuse it, as a row, before any process starts (an H200's
    session stopped the whole check there, 2026-11-29)."""
    def no_launch(*a, **k):
        raise AssertionError("a case that cannot run was launched")

    monkeypatch.setattr(check, "launch", no_launch)
    case = check.Case("nd", 1, "gloo", "cpu", check.parallel.get("nd").check_options())
    row = check.check_case(case, {}, str(tmp_path / "runs"))
    assert row["result"] == "skipped" and "does not divide world_size=1" in row["why"], row


def test_unknown_strategies_are_refused_before_any_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dlab", "check", "--strategies", "ddp,zeroo",
                           "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "zeroo not checkable" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("strategies", [
    # by default the command itself, end to end, on one strategy (nd's layouts are checked by
    # test_nd_parity and notebook 10; the slow case runs every family, nd included)
    ("ddp",),
    # every family (about 140 s); each has its own parity test in the default run
    pytest.param(check.QUICK, marks=pytest.mark.slow),
])
def test_check_quick_passes_on_this_machine(strategies, tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "dlab", "check", "--quick", "--json", str(out),
                           "--runs-dir", str(tmp_path / "runs"), "--strategies", ",".join(strategies)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    if not torch.cuda.is_available():
        assert report["machine"].startswith("no GPU found")
    rows = report["strategies"]
    assert {r["strategy"] for r in rows} == set(strategies)
    assert all(r["result"] == "ok" for r in rows), rows
    for r in rows:  # dlab's accounting against the independent formula, where there is one
        if r["formula_bytes"] is not None:
            assert r["model_state_bytes"] == r["formula_bytes"], r
    assert report["allreduce"] and all(b["dlab"] > 0 and b["peer"] > 0 for b in report["allreduce"])
    assert "passed, 0 failed" in proc.stdout
