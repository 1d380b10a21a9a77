"""A full disk and a hung file system, caused without filling or hanging the real one: the write
functions of the run directory are made to fail with ENOSPC, or to block, by monkeypatch (or, in
a rank's own process, by the same patch in a small script).

- full: the command says "no space left on <path>" in one line (no traceback), leaves no
  temporary file and no half-set-up run directory, and a run that had started records how it
  ended (in the space ``reserve`` set aside), so it never reads "lost";
- hung: a step stuck on the disk still ends at its deadline (the watchdog's report and log
  lines get a few seconds in a thread of their own), and the launcher's deadline holds while
  the record of the run's end blocks.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import TINY_GPT

import dlab
from dlab.core import rundir
from dlab.core.config import RunConfig
from dlab.core.rundir import DiskError, read_json, reserve, write_json
from dlab.procs import run as run_module

PACKAGE_ROOT = str(Path(dlab.__file__).resolve().parent.parent)


def _full(path, text) -> None:
    """A write that starts, then finds the disk full (a part of the file is left behind)."""
    with open(path, "w") as f:
        f.write(text[:10])
    raise OSError(errno.ENOSPC, "No space left on device")


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob(".*tmp")]


def test_a_full_disk_is_named_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "_write_new", _full)
    target = tmp_path / "launch.json"
    with pytest.raises(DiskError, match=rf"^no space left on {tmp_path}/launch\.json: free some"):
        write_json(target, {"a": 1})
    assert not target.exists() and not _leftovers(tmp_path)


#: each errno the disk checks tell apart, and how its message must begin (written here, apart
#: from dlab.core.rundir.DISK_ERRORS): a quota is not a full disk, nor a read-only or failing one
SAID = {errno.ENOSPC: "no space left on {path}: free some space there",
        errno.EDQUOT: "disk quota exceeded on {path}: your quota on that file system is used up",
        errno.EROFS: "{path} is on a read-only file system: write runs elsewhere",
        errno.EIO: "an input/output error writing {path}: the disk or the network file system"}


def test_the_disk_errors_told_apart_are_the_ones_tested():
    assert set(rundir.DISK_ERRORS) == set(SAID)


@pytest.mark.parametrize("code", sorted(SAID), ids=lambda code: errno.errorcode[code])
def test_each_disk_error_is_said_in_its_own_words_naming_the_path(code, tmp_path, monkeypatch,
                                                                  capsys):
    def refused(path, text):
        with open(path, "w") as f:
            f.write(text[:10])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(rundir, "_write_new", refused)
    target = tmp_path / "launch.json"
    with pytest.raises(DiskError) as info:
        write_json(target, {"a": 1})
    assert info.value.errno == code and str(info.value).startswith(SAID[code].format(path=target))
    assert not target.exists() and not _leftovers(tmp_path)
    # the command line says it in one line too, naming the file it could not write
    runs = tmp_path / "runs"
    monkeypatch.setattr(RunConfig, "save", lambda self, path: refused(path, "{}"))
    from dlab.cli.main import main
    assert main(["run", "single", "-n", "1", "--steps", "1", "--runs-dir", str(runs)]) == 1
    err = capsys.readouterr().err
    before, after = SAID[code].split("{path}")
    assert err.startswith(f"error: {before}{runs}/") and after in err, err  # the run's directory
    assert err.count("\n") == 1, err
    assert not any(runs.iterdir()), "a half-set-up run directory was left"


def test_the_reserved_record_is_written_in_place_on_a_full_disk(tmp_path, monkeypatch):
    target = tmp_path / "status.json"
    reserve(target)
    assert read_json(target) is None  # blanks read as "not written yet"
    monkeypatch.setattr(rundir, "_write_new", _full)
    write_json(target, {"state": "failed", "ranks": {"0": {"ok": False}}})
    assert read_json(target) == {"state": "failed", "ranks": {"0": {"ok": False}}}
    assert not _leftovers(tmp_path)


def test_a_run_that_cannot_be_set_up_is_removed_and_the_cli_says_why(runs_dir, monkeypatch, capsys):
    def save(self, path):
        _full(path, json.dumps(self.to_dict()))

    monkeypatch.setattr(RunConfig, "save", save)
    with pytest.raises(DiskError, match=rf"no space left on {runs_dir}/"):
        dlab.launch("single", 1, runs_dir=runs_dir, **TINY_GPT)
    assert not any(runs_dir.iterdir()), "a half-set-up run directory was left"
    from dlab.cli.main import main
    code = main(["run", "single", "-n", "1", "--steps", "1", "--runs-dir", str(runs_dir)])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"error: no space left on {runs_dir}/"), err
    assert "Traceback" not in err and not any(runs_dir.iterdir())


def test_a_run_records_its_end_when_the_disk_fills_before_it(runs_dir, monkeypatch):
    """The launcher's last write, status.json, finds the disk full: it goes into the space set
    aside when the run started, and the run reads "ok", not "lost"."""
    real = rundir._write_new

    def status_full(path, text):
        (_full if path.name.startswith(".status.json") else real)(path, text)

    monkeypatch.setattr(rundir, "_write_new", status_full)
    run = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, **{**TINY_GPT, "steps": 1})
    assert json.loads((run.path / "status.json").read_text())["state"] == "ok"
    assert dlab.attach(run.path).state == "ok" and not _leftovers(run.path)


RANK_ON_A_FULL_DISK = """
import errno, sys
from dlab.core import rundir
from dlab.runtime import rank

run = rundir.RunDir(sys.argv[1])
run.path.mkdir()
writer = rundir.RankWriter(run, 0)  # its report's space is set aside here


def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


class Full:  # from now on the disk is full: appends, new files and the log all fail
    name = str(run.metrics_file(0))
    write = flush = full


rundir._write_new = full
writer._metrics, sys.stderr = Full(), Full()


def body(state):
    state["step"] = 0
    writer.metric({"step": 0})


rank.serve(writer, 30.0, body)
"""


def test_a_rank_on_a_full_disk_reports_which_file_and_exits(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_ON_A_FULL_DISK)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], timeout=60,
                          env={"PYTHONPATH": PACKAGE_ROOT, "RANK": "0", "WORLD_SIZE": "1"},
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    report = read_json(tmp_path / "run/ranks/rank0.json")
    assert report["exception"] == "DiskError" and report["step"] == 0, report
    assert report["message"].startswith(f"no space left on {tmp_path}/run/metrics/rank0.jsonl")


RANK_ON_A_HUNG_DISK = """
import fcntl, os, sys, threading, time
from dlab.core import rundir
from dlab.runtime.watchdog import StepWatchdog

run = rundir.RunDir(sys.argv[1])
run.path.mkdir()
writer = rundir.RankWriter(run, 0)
# the disk hangs: a new file never gets written, and the log (fd 2: a pipe nobody reads, full)
# takes no more bytes
rundir._write_new = lambda path, text: threading.Event().wait()
read_end, write_end = os.pipe()
fcntl.fcntl(write_end, fcntl.F_SETFL, os.O_NONBLOCK)
try:
    while True:
        os.write(write_end, b"x" * 4096)
except BlockingIOError:
    pass
fcntl.fcntl(write_end, fcntl.F_SETFL, 0)
os.dup2(write_end, 2)
state = {"step": None}
StepWatchdog(state, float(sys.argv[2]), writer, 0).start()
state["step"] = 0
print("stuck", flush=True)
threading.Event().wait()  # the main thread, stuck on the disk as well
"""


def test_a_step_stuck_on_a_hung_disk_still_ends_at_its_deadline(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_ON_A_HUNG_DISK)
    deadline = 1.0
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), str(deadline)],
                            env={"PYTHONPATH": PACKAGE_ROOT}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "stuck\n"
        stuck = time.monotonic()
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    from dlab.runtime.watchdog import LAST_WORDS_S
    assert code == 1
    assert time.monotonic() - stuck < deadline + LAST_WORDS_S + 5, "it waited on the disk"


def test_the_launchers_deadline_holds_while_the_record_of_the_end_blocks(runs_dir, monkeypatch):
    release = threading.Event()
    real = rundir._write_new

    def status_hangs(path, text):
        if path.name.startswith(".status.json"):
            release.wait()
        real(path, text)

    monkeypatch.setattr(rundir, "_write_new", status_hangs)
    monkeypatch.setattr(run_module, "RECORD_WITHIN_S", 1.0)
    run = dlab.launch("single", 1, runs_dir=runs_dir, **{**TINY_GPT, "steps": 10**6})
    # the disk answers again after 30 s: a launcher that waits for it fails the time check
    # below, rather than hanging the test
    threading.Timer(30, release.set).start()
    try:
        next(iter(run.stream(timeout=120)))  # training
        start = time.monotonic()
        with pytest.warns(UserWarning, match="did not answer within 1 s"), \
                pytest.raises(TimeoutError, match="did not finish within 2"):
            run.wait(timeout=2)
        assert time.monotonic() - start < 2 + 2 + 1 + 5  # deadline, stop's grace, the record
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while read_json(run.path / "status.json") is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the record goes in once the disk answers again
    assert read_json(run.path / "status.json")["state"] == "timeout"
