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
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_GPT

import dlab
from dlab.analysis.diagnose import find_failure
from dlab.core import disk, rundir
from dlab.core.config import RunConfig
from dlab.core.disk import DiskError, reserve, write_json
from dlab.core.rundir import read_json
from dlab.runtime import checkpoint

PACKAGE_ROOT = str(Path(dlab.__file__).resolve().parent.parent)


def _full(path, text) -> None:
    """A write that starts, then finds the disk full (a part of the file is left behind)."""
    with open(path, "w") as f:
        f.write(text[:10])
    raise OSError(errno.ENOSPC, "No space left on device")


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob(".*tmp")]


def test_a_full_disk_is_named_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "_write_new", _full)
    target = tmp_path / "launch.json"
    with pytest.raises(DiskError, match=rf"^no space left on {tmp_path}/launch\.json: free some"):
        write_json(target, {"a": 1})
    assert not target.exists() and not _leftovers(tmp_path)


#: each errno the disk checks tell apart, and how its message must begin (written here, apart
#: from dlab.core.disk.DISK_ERRORS): a quota is not a full disk, nor a read-only or failing one
SAID = {errno.ENOSPC: "no space left on {path}: free some space there",
        errno.EDQUOT: "disk quota exceeded on {path}: your quota on that file system is used up",
        errno.EROFS: "{path} is on a read-only file system: write runs elsewhere",
        errno.EIO: "an input/output error writing {path}: the disk or the network file system"}


def test_the_disk_errors_told_apart_are_the_ones_tested():
    assert set(disk.DISK_ERRORS) == set(SAID)


@pytest.mark.parametrize("code", sorted(SAID), ids=lambda code: errno.errorcode[code])
def test_each_disk_error_is_said_in_its_own_words_naming_the_path(code, tmp_path, monkeypatch,
                                                                  capsys):
    def refused(path, text):
        with open(path, "w") as f:
            f.write(text[:10])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk, "_write_new", refused)
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
    monkeypatch.setattr(disk, "_write_new", _full)
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
    real = disk._write_new

    def status_full(path, text):
        (_full if path.name.startswith(".status.json") else real)(path, text)

    monkeypatch.setattr(disk, "_write_new", status_full)
    run = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, **{**TINY_GPT, "steps": 1})
    assert json.loads((run.path / "status.json").read_text())["state"] == "ok"
    assert dlab.attach(run.path).state == "ok" and not _leftovers(run.path)


class _Replica:
    """A strategy's checkpoint state, as a replica holds it: one tensor of 400 kB."""
    replicated = True

    def checkpoint_state(self):
        return {"params": {"w": checkpoint.piece(torch.arange(100_000.0))}, "optim": {},
                "hparams": []}


class _FillingFile:
    """A file on a disk with ``room`` bytes left: a write past them raises ENOSPC, as the OS
    does, after writing what fitted."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.file.write(bytes(data)[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_checkpoint_that_fills_the_disk_is_named_and_leaves_no_partial_one(
        tmp_path, monkeypatch, asynchronous):
    """torch.save's own writer turns the disk's ENOSPC into "unexpected pos ..." (no path, no
    errno): the error must name the file and say what to do, and the partial checkpoint (what
    filled the disk) must go; the previous complete one stays."""
    root = tmp_path / "checkpoints"
    saver = checkpoint.Checkpointer(root, 0, 1, keep=2, asynchronous=asynchronous)
    saver.save(_Replica(), 1)
    saver.wait()

    def filling_open(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        return _FillingFile(file, 4096) if "w" in mode else file

    monkeypatch.setattr(checkpoint, "open", filling_open, raising=False)
    with pytest.raises(DiskError) as info:
        saver.save(_Replica(), 2)
        saver.wait()
    assert str(info.value) == (f"no space left on {root}/.partial-step-00000002/rank0.pt: free "
                               f"some space there, or keep fewer checkpoints (keep_checkpoints=2), "
                               f"or write runs elsewhere (runs_dir, --runs-dir)")
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]


def test_the_launcher_removes_a_partial_checkpoint_once_the_run_has_ended(tmp_path):
    """A rank killed mid-save (or stopped at the teardown after a peer's disk error) cannot
    clean up: once every process of the run is gone, the launcher does."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / ".partial-step-00000004").mkdir(parents=True)
    (run_dir / "checkpoints" / ".partial-step-00000004" / "rank1.pt").write_bytes(b"x" * 1000)
    (run_dir / "checkpoints" / "step-00000002").mkdir()
    (run_dir / "config.json").write_text(json.dumps({"world_size": 2, "steps": 10}))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dlab.Run(run_dir, ended)._finish("stopped")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002"]


def test_a_rank_that_finds_the_disk_full_at_its_start_says_so_in_its_report(tmp_path,
                                                                            monkeypatch):
    """Its log cannot be written either: without the report the run read only "failed before
    any rank reported"."""
    real = disk._write_new

    def full_after_reserve(path, text):
        (real if path.name == "rank0.json" and text.isspace() else _full)(path, text)

    run = rundir.RunDir(tmp_path / "run")
    run.path.mkdir()
    (run.path / "config.json").write_text(json.dumps({"world_size": 1}))
    monkeypatch.setattr(disk, "_write_new", full_after_reserve)
    with pytest.raises(DiskError):
        rundir.RankWriter(run, 0)
    said = f"no space left on {run.path}/ranks/rank0.pid: free some space there"
    assert run.report(0)["exception"] == "DiskError" and run.report(0)["message"].startswith(said)
    failure = dlab.attach(run.path).failure()
    assert str(failure).startswith(f"rank 0 of 1 failed: DiskError: {said}"), str(failure)


class _Usage:
    def __init__(self, free: int):
        self.free = free


def test_a_runs_dir_without_room_for_a_runs_records_is_refused_before_it_starts(
        runs_dir, monkeypatch):
    """Less free space than a run sets aside to record its end (its status, each rank's
    report): refused before anything starts, saying how much is free."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(100 * 1024))
    with pytest.raises(DiskError, match=rf"^no space left on {runs_dir} \(100 KiB free\): "
                                        rf"free some space there"):
        dlab.launch("torch-ddp", 2, runs_dir=runs_dir, **TINY_GPT)
    assert not any(runs_dir.iterdir())


def test_a_run_that_failed_before_any_rank_reported_on_a_full_disk_says_so(tmp_path,
                                                                           monkeypatch):
    run = rundir.RunDir(tmp_path / "run")
    run.path.mkdir()
    (run.path / "config.json").write_text(json.dumps({"world_size": 2}))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(3 * 1024))
    text = str(find_failure(run, torchrun_exit=1))
    assert text.startswith("the run failed before any rank reported (torchrun exit code 1)\n"
                           f"hint: the file system of {run.path} has 3 KiB free: a full disk is "
                           f"the likely cause"), text


RANK_ON_A_FULL_DISK = """
import errno, sys
from dlab.core import disk, rundir
from dlab.runtime import rank

run = rundir.RunDir(sys.argv[1])
run.path.mkdir()
writer = rundir.RankWriter(run, 0)  # its report's space is set aside here


def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


class Full:  # from now on the disk is full: appends, new files and the log all fail
    name = str(run.metrics_file(0))
    write = flush = full


disk._write_new = full
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
from dlab.core import disk, rundir
from dlab.runtime.watchdog import StepWatchdog

run = rundir.RunDir(sys.argv[1])
run.path.mkdir()
writer = rundir.RankWriter(run, 0)
# the disk hangs: a new file never gets written, and the log (fd 2: a pipe nobody reads, full)
# takes no more bytes
disk._write_new = lambda path, text: threading.Event().wait()
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


LAUNCHER_ON_A_HUNG_DISK = """
import sys, time
from pathlib import Path
from dlab.cli.main import main
from dlab.core import disk
from dlab.procs import run

runs, thawed = sys.argv[1], Path(sys.argv[2])
real = disk._write_new


def status_hangs(path, text):
    if path.name.startswith(".status.json"):
        open(path, "w").close()  # the file is made; its bytes wait for the disk to answer
        while not thawed.exists():
            time.sleep(0.05)
    real(path, text)


disk._write_new, run.RECORD_WITHIN_S = status_hangs, 1.0
sys.exit(main(["run", "single", "-n", "1", "--steps", "1000000", "--deadline", "4",
               "--runs-dir", runs, "--model-opt", "n_layer=1", "--model-opt", "d_model=32",
               "--model-opt", "n_head=2", "--model-opt", "seq_len=32"]))
"""


def test_the_launchers_deadline_holds_while_the_record_of_the_end_blocks(runs_dir, tmp_path):
    """The record of the run's end blocks on the disk: the command still ends at its deadline,
    and, once the disk answers, the record goes in (the run reads "timeout", not "lost") and
    the write it had begun leaves no temporary file."""
    thawed = tmp_path / "thawed"
    cli = subprocess.Popen([sys.executable, "-c", LAUNCHER_ON_A_HUNG_DISK, str(runs_dir),
                            str(thawed)], env={**os.environ, "PYTHONPATH": PACKAGE_ROOT},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = cli.communicate(timeout=300)  # the disk answers only after the command ended
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        thawed.touch()
    assert cli.returncode == 1 and "did not finish within 4" in err, err
    assert "did not answer within 1 s" in err and "Traceback" not in err, err
    (run_dir,) = runs_dir.iterdir()
    deadline = time.monotonic() + 60
    while read_json(run_dir / "status.json") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_json(run_dir / "status.json")["state"] == "timeout"
    while _leftovers(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _leftovers(run_dir) and dlab.attach(run_dir).state == "timeout"
