"""The runtime end to end: launch, run directory, parity of the references, attach, runs that
start together, and the worker started by torchrun itself (a two-node rehearsal)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import TINY_GPT, assert_same_training, losses

import dlab
from dlab.core.rundir import RunDir
from dlab.procs.process import free_port

NOTEBOOK_00 = Path(__file__).resolve().parent.parent / "notebooks" / "00_start_here.ipynb"


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_ddp_matches_single(world_size, runs_dir, reference):
    run = dlab.launch("torch-ddp", world_size, runs_dir=runs_dir, wait=True, save_final=True,
                      **TINY_GPT)
    assert_same_training(run, reference(**TINY_GPT))
    # every rank logs the same global loss
    assert all(losses(run, r) == losses(run, 0) for r in range(world_size))


def test_run_directory_holds_the_contract(runs_dir):
    run = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, wait=True, **TINY_GPT)
    d = run.dir
    assert d.config()["strategy"] == "torch-ddp"
    assert run.status()["state"] == "ok" and run.status()["exit_codes"] == {"0": 0, "1": 0}
    for r in (0, 1):
        ms = run.metrics(r)
        assert [m["step"] for m in ms] == [0, 1, 2, 3]
        assert set(ms[0]["memory"]) == set(dlab.core.metrics.CATEGORIES)
        assert ms[0]["tokens"] == 8 * 32 and ms[0]["tokens_per_s"] > 0
        kinds = {e["kind"] for e in run.timeline(r)}
        assert {"forward", "backward", "optimizer", "step", "all_reduce"} <= kinds
        assert d.report(r)["ok"] is True
        assert d.log_file(r).exists()
    summary = run.summary()
    assert [row["rank"] for row in summary.rows] == [0, 1] and "ok" in str(summary)


def test_attach_reads_a_finished_run(runs_dir):
    run = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, **TINY_GPT)
    again = dlab.attach(run.path)
    assert again.state == "ok" and losses(again) == losses(run)
    with pytest.raises(FileNotFoundError, match="not a dlab run directory"):
        dlab.attach(runs_dir)


def test_two_runs_at_once_do_not_collide(runs_dir):
    a = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, name="same", **TINY_GPT)
    b = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, name="same", **TINY_GPT)
    a.wait(timeout=120)
    b.wait(timeout=120)
    assert a.path != b.path
    ports = {RunDir(r.path).path.joinpath("launch.json").read_text() for r in (a, b)}
    assert len(ports) == 2 and losses(a) == losses(b)


def test_two_torchrun_nodes_write_one_run_directory(tmp_path):
    """A multi-node rehearsal: two torchrun agents (--nnodes 2, c10d rendezvous on localhost),
    one rank each, exactly as a two-node cluster job would start them."""
    run_dir, port = tmp_path / "two-nodes", free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=rehearsal",
           f"--log-dir={run_dir / 'torchelastic'}", "-m", "dlab.worker", "--run-dir", str(run_dir),
           "torch-ddp", "--steps", "3",
           "--model-opt", "n_layer=1", "--model-opt", "d_model=32", "--model-opt", "n_head=2"]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    outputs = [a.communicate(timeout=120)[0].decode() for a in agents]
    if any(a.returncode for a in agents):  # shown in full with the failure (an assertion's is cut)
        print(*(f"--- agent {i}, exit {a.returncode}:\n{out}" for i, (a, out) in
                enumerate(zip(agents, outputs))), sep="\n")
    assert all(a.returncode == 0 for a in agents), [a.returncode for a in agents]
    run = dlab.attach(run_dir)
    assert run.world_size == 2 and run.state == "ok"
    assert [len(run.metrics(r)) for r in (0, 1)] == [3, 3]
    assert losses(run, 0) == losses(run, 1)


def test_a_rendezvous_port_taken_before_torchrun_binds_it_is_retried(runs_dir, monkeypatch):
    """``free_port`` hands out a port that a stranger then listens on (the race it cannot
    close): the launcher sees the stranger within seconds, starts torchrun again on another
    port, and the run completes instead of waiting 10 minutes on the stranger."""
    launch_module = sys.modules["dlab.procs.launch"]
    stranger = socket.socket()
    stranger.bind(("127.0.0.1", 0))
    stranger.listen()
    taken = stranger.getsockname()[1]
    ports = iter([taken])
    real = launch_module.free_port
    monkeypatch.setattr(launch_module, "free_port", lambda: next(ports, None) or real())
    try:
        start = time.monotonic()
        run = dlab.launch("single", 1, runs_dir=runs_dir, **{**TINY_GPT, "steps": 2})
        launched = time.monotonic() - start
        run.wait(timeout=120)
    finally:
        stranger.close()
    info = json.loads((run.path / "launch.json").read_text())
    assert info["attempt"] == 2 and info["port"] != taken
    assert f"took rendezvous port {taken}" in (run.path / "torchrun.log").read_text()
    assert launched < 30 and run.state == "ok"


def test_torchrun_leaves_nothing_in_the_temp_dir(runs_dir, tmp_path, monkeypatch):
    """torchrun's agent makes a log directory (``torchelastic_*``) in the temp dir for every run
    unless told where; a day of runs left hundreds. dlab gives it one inside the run directory."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # torchrun's, and its ranks'
    run = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, **{**TINY_GPT, "steps": 1})
    assert run.state == "ok"
    assert not list(temp.glob("torchelastic_*")), [p.name for p in temp.iterdir()]
    assert (run.path / "torchelastic").is_dir()


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """A temp dir of its own for this test and every process it starts (torchrun's agent makes
    its ``torchelastic_*`` folders there when not told where)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    return temp


def test_notebook_00s_own_torchrun_leaves_nothing_in_the_temp_dir(temp_dir, tmp_path, monkeypatch):
    """The cell of notebook 00 that starts torchrun as a cluster would, run as it is written
    (the dashboard it opens replaced by nothing: the cell then waits for torchrun itself)."""
    from dlab.ui import dashboard
    cell = next(c for c in json.loads(NOTEBOOK_00.read_text())["cells"]
                if "torch.distributed.run" in "".join(c["source"]) and c["cell_type"] == "code")
    monkeypatch.setattr(dashboard, "watch", lambda run: run)
    monkeypatch.chdir(tmp_path)
    scope = {"sys": sys, "dlab": dlab}
    exec("".join(cell["source"]), scope)  # noqa: S102 - the notebook's own cell
    assert scope["agent"].returncode == 0 and dlab.attach(scope["run_dir"]).state == "ok"
    assert not list(temp_dir.glob("torchelastic_*")), [p.name for p in temp_dir.iterdir()]


def test_bench_launchs_plain_torchrun_leaves_nothing_in_the_temp_dir(temp_dir, tmp_path,
                                                                    monkeypatch):
    from dlab.bench import launch as bench_launch
    monkeypatch.setattr(bench_launch, "WORK", {"steps": 1, "batch_size": 8, "model_options": {
        "n_layer": 1, "d_model": 32, "n_head": 2}})  # the command is what is tested, not the work
    bench_launch._torchrun(1, tmp_path)
    assert not list(temp_dir.glob("torchelastic_*")), [p.name for p in temp_dir.iterdir()]
