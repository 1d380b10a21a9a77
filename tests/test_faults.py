"""A failing, killed, hung or interrupted run: every process gone quickly, and the error names
the rank and shows why. Each test also checks (runs_dir fixture) that nothing is left behind."""
from __future__ import annotations

import _thread
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import TINY_GPT, processes_of

import dlab
from dlab.analysis.diagnose import own_error
from dlab.runtime import checkpoint

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


@pytest.mark.slow  # ~25 s: four ranks
def test_a_hung_rank_is_named_first_at_the_deadline(runs_dir):
    """Rank 1 stops outside any collective; the others wait for it in their next all-reduce.
    Its step watchdog reports it at the deadline, with where it is stuck, and the error names it
    rather than the ranks that timed out waiting (the symptoms)."""
    start = time.monotonic()
    err, _ = _fail(runs_dir, {"rank": 1, "step": 2, "kind": "hang"}, timeout_s=4)
    assert err.rank == 1 and err.exception == "StepDeadline" and err.step == 2, str(err)
    assert "deadline (timeout_s=4 s)" in str(err)
    assert "stuck at faults.py" in str(err) and "in maybe_inject" in str(err)
    assert time.monotonic() - start < 60


def test_a_single_rank_stuck_outside_a_collective_ends_at_its_deadline(runs_dir):
    run = dlab.launch("single", 1, runs_dir=runs_dir, fault={"rank": 0, "step": 1, "kind": "hang"},
                      **{**TINY_GPT, "steps": 3, "timeout_s": 3})
    with pytest.raises(dlab.RunFailed) as info:
        run.wait(timeout=120)
    err = info.value
    assert err.rank == 0 and err.exception == "StepDeadline" and err.step == 1
    assert "outside any collective" in str(err) and "maybe_inject" in str(err)
    stuck_since = (run.path / "metrics" / "rank0.jsonl").stat().st_mtime
    assert 3 <= run.dir.report(0)["time"] - stuck_since < 8, "ends at the deadline, not later"
    assert run.state == "failed" and not processes_of(run.path)


def test_cli_deadline_bounds_the_whole_run(runs_dir):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dlab", "run", "single", "-n", "1", "--steps",
                           "1000000", "--deadline", "8", "--runs-dir", str(runs_dir),
                           "--model-opt", "n_layer=1", "--model-opt", "d_model=32",
                           "--model-opt", "n_head=2", "--model-opt", "seq_len=32"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "did not finish within 8" in done.stderr, done.stderr
    assert "raise --deadline" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - start < 60
    (run_dir,) = runs_dir.iterdir()
    assert dlab.attach(run_dir).state == "timeout"


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


#: a stand-in for torchrun whose rank 1 reports an error only when the teardown's SIGTERM comes
#: (a peer gone from under its collective), and, given "early", rank 0 one before any stop
TEARDOWN_CASUALTY = """
import json, signal, sys, time
from pathlib import Path
ranks = Path(sys.argv[1]) / "ranks"
def report(rank, message):
    (ranks / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "ok": False, "time": time.time(),
        "exception": "RuntimeError", "message": message, "traceback": message}))
def torn_down(signum, frame):
    report(1, "Connection closed by peer")
    sys.exit(1)
signal.signal(signal.SIGTERM, torn_down)
if sys.argv[2] == "early":
    report(0, "a real failure")
(ranks / "up").write_text("")
time.sleep(60)
"""


@pytest.mark.parametrize("early,clicked", [(False, False), (False, True), (True, False)])
def test_a_stop_names_a_rank_that_failed_before_it_not_one_the_teardown_broke(tmp_path, early,
                                                                              clicked):
    """The dashboard's Stop ends the run as "stopped", whether ``wait`` sees it first
    (``stop_requested``) or the button's handler stops the run from another thread while
    ``wait`` polls; a rank whose collective broke because its peers were torn down reports an
    error after the Stop, a casualty that ``wait`` does not raise. A rank that had failed before
    the Stop is still the failure."""
    run_dir = tmp_path / "run"
    (run_dir / "ranks").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"world_size": 2}))
    proc = subprocess.Popen([sys.executable, "-c", TEARDOWN_CASUALTY, str(run_dir),
                             "early" if early else "late"], start_new_session=True)
    while not (run_dir / "ranks" / "up").exists():
        assert proc.poll() is None
        time.sleep(0.02)
    run = dlab.Run(run_dir, proc)
    requested = threading.Event()
    if clicked:  # Dashboard.request_stop: the flag, then the run stopped from the comm's thread
        threading.Timer(0.3, lambda: (requested.set(), run.stop(reason="stopped"))).start()
    else:
        requested.set()
    if early:
        with pytest.raises(dlab.RunFailed, match="a real failure"):
            run.wait(timeout=30, stop_requested=requested.is_set)
    else:
        assert run.wait(timeout=30, stop_requested=requested.is_set) is run
        assert json.loads((run_dir / "ranks" / "rank1.json").read_text())["ok"] is False
    assert proc.poll() is not None
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"


@pytest.mark.parametrize("reason, state", [(None, "preempted"), ("notice", "preempted"),
                                           ("interrupted", "stopped"), ("timeout", "timeout"),
                                           ("stopped", "stopped")])
def test_ranks_that_stopped_as_preempted_make_the_run_read_preempted_only_on_a_notice(
        tmp_path, reason, state):
    """Checkpointing ranks take any SIGTERM for a scheduler's notice and report "preempted". A
    run whose launcher stopped it for its own reasons (Ctrl-C, a closed output pipe, its
    deadline) reads as what stopped it; only a notice passed on, or a run that ended on its own
    (a SIGTERM reached torchrun from elsewhere), reads "preempted"."""
    run_dir = tmp_path / "run"
    (run_dir / "ranks").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"world_size": 2, "steps": 10}))
    for r in (0, 1):
        (run_dir / "ranks" / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "ok": True, "preempted": True, "resume_from": 3}))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dlab.Run(run_dir, ended)._finish(reason)
    assert json.loads((run_dir / "status.json").read_text())["state"] == state


#: torchrun's log (torch 2.13) after rank 1 was SIGKILLed while the ranks wrote a checkpoint:
#: rank 0, waiting for rank 1's part, took the teardown's SIGTERM for a preemption notice and
#: was SIGKILLed 30 s later, so the table lists both ranks killed by SIGKILL
TORN_DOWN_AFTER_A_KILL = """\
W1127 19:59:56.802000 19316 torch/.../api.py:1028] Sending process 19347 closing signal SIGTERM
W1127 20:00:26.803000 19316 torch/.../api.py:1047] Unable to shutdown process 19347 via 15, \
forcefully exiting via 9
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
dlab.worker FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-27_20:00:26
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 19347)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 19347
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_19:59:56
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 19348)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 19348
======================================================
"""


def _run_with(tmp_path, torchrun_log: str, reports: dict, world_size: int = 2) -> dlab.RunFailed:
    run_dir = tmp_path / "run"
    (run_dir / "ranks").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"world_size": world_size, "steps": 10}))
    (run_dir / "torchrun.log").write_text(torchrun_log)
    for r, report in reports.items():
        (run_dir / "ranks" / f"rank{r}.json").write_text(json.dumps({"rank": r, **report}))
    return dlab.attach(run_dir).failure()


def _when(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%d_%H:%M:%S"))


@pytest.mark.parametrize("rank0", [
    None,  # no report: torchrun SIGKILLed it at the end of the teardown
    # its watchdog reported it stuck, waiting for rank 1's part, after rank 1 had died
    {"ok": False, "exception": "StepDeadline", "time": _when("2026-11-27_19:59:59"),
     "message": "step 3 has run 4.1 s, past the run's deadline of 4 s, outside any collective"},
    # a peer's symptom, in the same second as the kill
    {"ok": False, "exception": "DistBackendError", "time": _when("2026-11-27_19:59:56") + 0.5,
     "message": "[pair.cc:534] Read error [127.0.0.1]:40104: Connection reset by peer"},
], ids=["torn-down", "its-watchdog-later", "connection-reset"])
def test_the_rank_killed_first_is_named_not_one_that_failed_after_it(tmp_path, rank0):
    """A rank that died of a signal without a report wins over ranks that failed after it
    because it vanished, and over a rank torchrun itself ended at the teardown."""
    err = _run_with(tmp_path, TORN_DOWN_AFTER_A_KILL, {0: rank0} if rank0 else {})
    assert err.rank == 1 and err.exit_code == -9, str(err)
    assert str(err).startswith("rank 1 of 2 was killed by SIGKILL"), str(err)


#: torchrun's log (torch 2.13, one core busy) after rank 3 exited with code 3 at step 1: the
#: others' reads failed first, torchrun saw rank 1 fail first and sent its closing SIGTERM to
#: every rank it still listed, rank 3 among them, which had already exited on its own
SIGNALLED_AFTER_ITS_OWN_EXIT = """\
W1128 01:18:50.702000 31163 torch/.../api.py:1028] Sending process 31167 closing signal SIGTERM
W1128 01:18:50.703000 31163 torch/.../api.py:1028] Sending process 31169 closing signal SIGTERM
W1128 01:18:50.703000 31163 torch/.../api.py:1028] Sending process 31170 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  time      : 2026-11-28_01:18:50
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 31167)
[2]:
  time      : 2026-11-28_01:18:50
  rank      : 2 (local_rank: 2)
  exitcode  : 1 (pid: 31169)
[3]:
  time      : 2026-11-28_01:18:50
  rank      : 3 (local_rank: 3)
  exitcode  : 3 (pid: 31170)
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_01:18:50
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 31168)
"""


def test_a_rank_that_exited_on_its_own_is_named_though_the_teardown_signalled_it(tmp_path):
    """A closing signal makes a rank a casualty only when the signal is what ended it (its exit
    code is the signal's): rank 3 exited with code 3 before torchrun's SIGTERM reached it, and
    the others' errors are a peer's symptoms, so rank 3 is the cause (it was reported as rank 1)."""
    reset = {"ok": False, "exception": "RuntimeError", "time": _when("2026-11-28_01:18:50") + 0.66,
             "message": "[pair.cc:537] Read error [127.0.0.1]:1922: Connection reset by peer"}
    err = _run_with(tmp_path, SIGNALLED_AFTER_ITS_OWN_EXIT, {0: reset, 1: reset, 2: reset}, 4)
    assert err.rank == 3 and err.exit_code == 3, str(err)


class _Shard:
    """A ZeRO rank's checkpoint state: every rank writes its own part."""
    replicated = False

    def checkpoint_state(self):
        return {"params": {"w": checkpoint.piece(torch.ones(4))}, "optim": {}, "hparams": []}


def test_a_checkpoint_writer_waiting_for_a_killed_peer_stops_at_once(tmp_path):
    """Rank 0 commits a sharded checkpoint once every writer announced its part. A writer
    killed midway never does: rank 0 says so within seconds, as a symptom (a peer gone), where
    it waited for 600 s, ignoring the teardown's SIGTERM as a preemption notice."""
    run_dir = tmp_path / "run"
    (run_dir / "ranks").mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run_dir / "ranks" / "rank1.pid").write_text(json.dumps({"pid": gone.pid,
                                                            "host": socket.gethostname()}))
    saver = checkpoint.Checkpointer(run_dir / "checkpoints", 0, 2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1, a peer, ended before it finished") as info:
        saver.save(_Shard(), 3)
    assert time.monotonic() - start < 60, "it waited for the writer's own deadline"
    assert not own_error({"exception": "RuntimeError", "message": str(info.value)})
    assert not list((run_dir / "checkpoints").glob(".partial-*"))
