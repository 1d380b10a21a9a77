"""A failing, killed, hung or interrupted run: every process gone quickly, and the error names
the rank and shows why. Each test also checks (runs_dir fixture) that nothing is left behind."""
from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest
from conftest import processes_of
from helpers import TINY_GPT

import dlab

LONG = {**TINY_GPT, "steps": 10**6}  # never reached: each test ends the run long before


def _fail(runs_dir, fault, **extra) -> tuple[dlab.RunFailed, float]:
    """Run with ``fault`` until it fails; the error, and the seconds from the faulty rank's last
    metric line (written just before the step that injects the fault) to every process gone."""
    run = dlab.launch("torch-ddp", 4, runs_dir=runs_dir, fault=fault, **{**TINY_GPT, "steps": 6, **extra})
    with pytest.raises(dlab.RunFailed) as info:
        run.wait(timeout=120)
    assert run.state == "failed" and not processes_of(run.path)
    last_metric = (run.path / "metrics" / f"rank{fault['rank']}.jsonl").stat().st_mtime
    return info.value, time.time() - last_metric


def test_a_rank_that_raises_is_named_with_its_traceback(runs_dir):
    start = time.monotonic()
    err, _ = _fail(runs_dir, {"rank": 1, "step": 3, "kind": "raise"})
    assert err.rank == 1 and err.exception == "InjectedFault" and err.step == 3
    assert "rank 1 of 4 failed at step 3" in str(err)
    assert "raise InjectedFault" in str(err)  # the traceback tail is in the message
    assert err.exit_codes[1] == 1
    assert time.monotonic() - start < 60


def test_a_killed_rank_is_named_and_nothing_hangs(runs_dir):
    err, gone_after = _fail(runs_dir, {"rank": 2, "step": 2, "kind": "kill"})
    assert err.rank == 2 and err.exit_code == -9
    assert "killed by SIGKILL" in str(err)
    assert gone_after < 10, "every rank must be gone within 10 s of the kill"


def test_a_silent_exit_is_reported_with_its_code(runs_dir):
    err, gone_after = _fail(runs_dir, {"rank": 3, "step": 1, "kind": "exit"})
    assert err.rank == 3 and err.exit_code == 3 and "exited with code 3" in str(err)
    assert gone_after < 10


def test_a_collective_that_never_completes_ends_at_the_deadline(runs_dir):
    start = time.monotonic()
    err, _ = _fail(runs_dir, {"rank": 1, "step": 2, "kind": "hang"}, timeout_s=4)
    assert "deadline (timeout_s=4 s)" in str(err) and 1 in err.unreported
    assert err.rank != 1  # the stuck rank cannot report; a waiting one does, at the deadline
    assert time.monotonic() - start < 60


def test_failure_reaches_the_caller_within_seconds(runs_dir):
    run = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, fault={"rank": 1, "step": 3, "kind": "raise"},
                      **LONG)
    with pytest.raises(dlab.RunFailed):
        run.wait(timeout=120)
    raised_at = run.dir.report(1)["time"]
    assert time.time() - raised_at < 10, "every rank must be gone within 10 s of the failure"


@pytest.fixture
def interruptible():
    """Python's SIGINT handler, as a terminal or a kernel has it. A job a shell starts in the
    background inherits SIGINT ignored, and then ``interrupt_main`` does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupted_wait_leaves_no_process(runs_dir, interruptible):
    run = dlab.launch("torch-ddp", 4, runs_dir=runs_dir, **LONG)
    for _ in run.stream(timeout=120):
        break  # the run is training
    threading.Timer(0.5, _thread.interrupt_main).start()  # what a notebook's stop button sends
    with pytest.raises(KeyboardInterrupt):
        run.wait(timeout=120)  # a timeout, not a hang, if the interrupt never came
    stopped = time.monotonic()
    while processes_of(run.path) and time.monotonic() - stopped < 5:
        time.sleep(0.05)
    assert not processes_of(run.path), "an interrupted run must leave no process within 5 s"
    assert run.state == "stopped"


def test_stop_ends_a_running_run(runs_dir):
    run = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, **LONG)
    next(iter(run.stream(timeout=120)))
    run.stop()
    assert run.state == "stopped" and not processes_of(run.path)
