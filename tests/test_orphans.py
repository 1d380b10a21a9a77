"""However the launcher dies - the CLI sent SIGTERM (coreutils' timeout, Slurm's cancel), SIGHUP
(a closed terminal), SIGINT or SIGKILL, or a notebook kernel killed while a run goes - no
torchrun or rank process is left within 10 s, and the run directory does not read "running"."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import processes_of

import dlab

TINY_FLAGS = ["--model-opt", "n_layer=1", "--model-opt", "d_model=32", "--model-opt", "n_head=2",
              "--model-opt", "seq_len=32", "--batch-size", "8", "--steps", "1000000"]


def _training(runs_dir, timeout: float = 120.0):
    """The run directory under ``runs_dir`` once its rank 0 has written a metric line."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if runs := _training_runs(runs_dir):
            return runs[0]
        time.sleep(0.1)
    raise AssertionError(f"no run under {runs_dir} started training within {timeout} s")


def _training_runs(runs_dir) -> list:
    return sorted(m.parent.parent for m in runs_dir.glob("*/metrics/rank0.jsonl") if m.stat().st_size)


def _workers_gone(run_dir, within: float = 10.0) -> None:
    end = time.monotonic() + within
    while processes_of(run_dir) and time.monotonic() < end:
        time.sleep(0.1)
    left = processes_of(run_dir)
    assert not left, f"left behind: {[p.info['cmdline'][:4] for p in left]}"


SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL]


@pytest.mark.slow  # ~20-25 s each on a loaded 2-core machine
@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_cli_killed_by_a_signal_leaves_no_process(sig, runs_dir):
    cli = subprocess.Popen([sys.executable, "-m", "dlab", "run", "torch-ddp", "-n", "2",
                            "--runs-dir", str(runs_dir), *TINY_FLAGS],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = _training(runs_dir)
        cli.send_signal(sig)
        _, err = cli.communicate(timeout=20)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    _workers_gone(run_dir)
    state = dlab.attach(run_dir).state
    if sig == signal.SIGKILL:
        assert cli.returncode == -signal.SIGKILL
        assert state == "lost", state
    else:
        assert cli.returncode == 128 + sig, err
        assert "Traceback" not in err and err.strip().count("\n") == 0, err
        assert f"interrupted by {signal.Signals(sig).name}" in err
        assert state == "stopped", state


KERNEL = """
import sys, threading, time
import dlab
# Launch from a thread that ends at once, as a widget callback would: the run must not die
# with that thread (the parent-death signal follows the forking thread).
t = threading.Thread(target=lambda: dlab.launch("torch-ddp", 2, runs_dir=sys.argv[1], steps=10**6,
                     model_options={"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32}))
t.start(); t.join()
run = dlab.launch("torch-ddp", 2, runs_dir=sys.argv[1], name="watched", dashboard=True,
                  steps=10**6, model_options={"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32})
"""


@pytest.mark.slow  # ~40 s: two runs
def test_a_killed_kernel_leaves_no_process(runs_dir, tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(KERNEL))
    package_root = str(Path(dlab.__file__).resolve().parent.parent)  # this dlab, not an installed one
    kernel = subprocess.Popen([sys.executable, str(script), str(runs_dir)],
                              env={**os.environ, "PYTHONPATH": package_root},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 180
        while len(_training_runs(runs_dir)) < 2 and time.monotonic() < end:
            time.sleep(0.2)
        runs = _training_runs(runs_dir)
        assert len(runs) == 2, "both runs should be training by now"
        assert all(processes_of(r) for r in runs), "the thread's run died with its thread"
        os.kill(kernel.pid, signal.SIGKILL)
        kernel.wait(timeout=10)
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
    for run_dir in runs:
        _workers_gone(run_dir)
        assert dlab.attach(run_dir).state == "lost"
    with pytest.raises(RuntimeError, match="is lost"):
        dlab.attach(runs[0]).wait(timeout=30)
