"""The run directory: the one contract between ranks and whoever watches them.

::

    runs/20261122-101500-ddp-w4/
      config.json              the RunConfig
      launch.json              how it was started (command, port, pid) - only when dlab launched it
      torchrun.log             torchrun's own output (agent messages, failure summary)
      torchelastic/            torchrun's agent's per-attempt folders (its --log-dir)
      logs/rank{r}.log         each rank's stdout and stderr
      metrics/rank{r}.jsonl    one JSON object per step: loss, step_time, tokens/s, memory, comm
      timeline/rank{r}.jsonl   one JSON object per event: kind, step, start, end (seconds after
                               the clock-aligning barrier), plus mb / stage where they apply
      ranks/rank{r}.pid        written by the rank when it starts: its pid and host
      ranks/rank{r}.json       written by the rank when it ends: ok, or its exception + traceback
      ranks/rank{r}.exit.json  a forked rank's end other than status 0, by its keeper (exit code,
                               negative for a signal; when; whether a signal passed on ended it)
      status.json              written by the launcher when the run ends: state, exit code per rank
      final_state.pt           full final parameters, from rank 0 (only with save_final=True);
      final_state_rank{r}.pt   the same from every rank (replicas must agree bit for bit)

Everything is append-only JSON lines or whole files written by rename, so a reader can follow a
live run (``follow``) or open a finished one, from this kernel, a later one, or a cluster's
shared file system. Ranks never talk to the notebook in any other way.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import psutil

from dlab.core.disk import disk_error, reserve, write_json


class CorruptRunFile(ValueError):
    """A file of a run directory that cannot be read as what it should hold."""


def read_json(path: Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return default


def read_json_object(path: Path) -> dict | None:
    """A file that must hold one JSON object (a status, a rank's report): the object, or None
    when it is not there (yet) or not whole; a file that holds valid JSON of another kind is
    reported with a warning naming it and read as not there, so the rest of the run is shown."""
    obj = read_json(path)
    if obj is not None and not isinstance(obj, dict):
        warnings.warn(f"{path}: holds a JSON {type(obj).__name__}, not the object dlab writes "
                      f"there; ignored it (restore or remove the file)", stacklevel=3)
        return None
    return obj


class Kind(NamedTuple):
    """What a field of a record must hold: ``name`` for the warning, ``fits`` to test it."""
    name: str
    fits: Callable[[object], bool]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


INTEGER = Kind("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
NUMBER = Kind("a number", _number)
#: a step's time: rates and shares of the step divide by it
POSITIVE = Kind("a positive number of seconds", lambda v: _number(v) and v > 0)
TEXT = Kind("a string", lambda v: isinstance(v, str))
#: an object every value of which is a number (a rank's memory by category)
NUMBERS = Kind("an object", lambda v: isinstance(v, dict))
#: what the summary, the figures and the dashboard read in every record, by the folder its file
#: is in; a record without one of them, or with one of another kind, is skipped with a warning
RECORD_FIELDS = {
    "metrics": {("step",): INTEGER, ("loss",): NUMBER, ("step_time",): POSITIVE,
                ("tokens_per_s",): NUMBER, ("mfu",): NUMBER, ("memory",): NUMBERS,
                ("comm", "sent_bytes"): NUMBER, ("comm", "seconds"): NUMBER},
    "timeline": {("kind",): TEXT, ("step",): INTEGER, ("start",): NUMBER, ("end",): NUMBER},
}
#: what they read where a record has it (older records lack some; ``wire_bytes`` is null where
#: the transport cannot be measured): absent or null is fine, another kind is not
OPTIONAL_FIELDS = {
    "metrics": {("hfu",): NUMBER, ("busy_s",): NUMBER, ("idle_s",): NUMBER,
                ("cuda_peak_bytes",): NUMBER, ("comm", "wire_bytes"): NUMBER,
                ("comm", "exposed_seconds"): NUMBER, ("comm", "busy_seconds"): NUMBER},
    "timeline": {("stage",): INTEGER},
}


def record_problem(record, fields: dict, optional: dict | None = None) -> str | None:
    """What is wrong with ``record`` against ``fields`` and ``optional`` (``RECORD_FIELDS``,
    ``OPTIONAL_FIELDS``), naming the field (``memory.parameters``, ``comm.wire_bytes``), or
    None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for path, kind in [*fields.items(), *(optional or {}).items()]:
        value = record
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        name = ".".join(path)
        if value is None:
            if path in fields:
                return f"no {name!r} field"
            continue
        if not kind.fits(value):
            return f"its {name!r} is {value!r}, not {kind.name}"
        if kind is NUMBERS:
            bad = next((k for k, v in value.items() if not _number(v)), None)
            if bad is not None:
                return f"its '{name}.{bad}' is {value[bad]!r}, not a number"
    return None


class JsonlTail:
    """Reads the complete lines appended to a JSON-lines file since the last call. A line that
    is still being written (no newline yet) is left for next time. A complete line that is not
    JSON (a torn write: a rank killed mid-line, then a restart appending after it) is skipped
    with a warning naming the file and the line number; the lines around it are kept. So is a
    record that lacks what readers need of it or holds it as another kind, naming the field
    (``fields``; by default ``RECORD_FIELDS`` and ``OPTIONAL_FIELDS`` of the folder the file
    is in: ``metrics/``, ``timeline/``)."""

    def __init__(self, path: Path, fields: dict | None = None):
        self.path, self.offset, self.lines = Path(path), 0, 0
        folder = self.path.parent.name
        self.fields = RECORD_FIELDS.get(folder, {}) if fields is None else fields
        self.optional = OPTIONAL_FIELDS.get(folder, {}) if fields is None else {}

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        out = []
        for line in chunk[:end].split(b"\n"):
            self.lines += 1
            if not line.strip():
                continue
            try:
                records = [json.loads(line)]
            except (json.JSONDecodeError, UnicodeDecodeError):
                records = _record_after_torn_start(line)
                warnings.warn(f"{self.path}, line {self.lines}: not a JSON record (a torn write, "
                              f"e.g. a rank killed mid-line); skipped the torn part"
                              + (", kept the whole record appended after it" if records else ""),
                              stacklevel=2)
            for record in records:
                problem = (record_problem(record, self.fields, self.optional) if self.fields
                           else None)
                if problem:
                    warnings.warn(f"{self.path}, line {self.lines}: a record with {problem}; "
                                  f"skipped it, the other records are shown", stacklevel=2)
                else:
                    out.append(record)
        return out


def _record_after_torn_start(line: bytes) -> list[dict]:
    """A restart appends its first record right after the torn bytes, on the same line: the
    last ``{`` from which the rest of the line parses as one JSON object is that record."""
    at = line.rfind(b"{", 1)
    while at > 0:
        try:
            obj = json.loads(line[at:])
            return [obj] if isinstance(obj, dict) else []
        except (json.JSONDecodeError, UnicodeDecodeError):
            at = line.rfind(b"{", 1, at)
    return []


def preempted_or_ok(reports: dict) -> str:
    """The state of a run every rank of which ended well: "preempted" when they stopped on a
    scheduler's notice (``dlab.runtime.preemption``), else "ok"."""
    return "preempted" if any(rep and rep.get("preempted") for rep in reports.values()) else "ok"


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def create(cls, root: str | Path, label: str) -> RunDir:
        """A new, unique directory ``root/<time>-<label>``; two runs started in the same second,
        from one process or two, get different directories (mkdir is atomic)."""
        root = Path(root)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        for n in range(1000):
            path = root / (f"{stamp}-{label}" + (f"-{n}" if n else ""))
            try:
                root.mkdir(parents=True, exist_ok=True)
                path.mkdir()
            except FileExistsError:
                continue
            except OSError as e:
                raise disk_error(e, root) from None
            reserve(path / "status.json")
            return cls(path)
        raise RuntimeError(f"could not create a fresh run directory under {root}")

    # paths ------------------------------------------------------------------------------
    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def metrics_file(self, rank: int) -> Path:
        return self.path / "metrics" / f"rank{rank}.jsonl"

    def timeline_file(self, rank: int) -> Path:
        return self.path / "timeline" / f"rank{rank}.jsonl"

    def log_file(self, rank: int) -> Path:
        return self.path / "logs" / f"rank{rank}.log"

    def report_file(self, rank: int) -> Path:
        return self.path / "ranks" / f"rank{rank}.json"

    def pid_file(self, rank: int) -> Path:
        return self.path / "ranks" / f"rank{rank}.pid"

    def exit_file(self, rank: int) -> Path:
        return self.path / "ranks" / f"rank{rank}.exit.json"

    # reading ----------------------------------------------------------------------------
    def config(self) -> dict:
        """The run's config; ``{}`` while it is not written yet. A config.json that is there
        but is not a JSON object raises ``CorruptRunFile`` naming it (a run without a readable
        config cannot be read as anything, least of all as an empty successful run)."""
        path = self.path / "config.json"
        try:
            text = path.read_text()
        except FileNotFoundError:
            return {}
        try:
            cfg = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptRunFile(f"{path} is not valid JSON ({e}); the run cannot be read. "
                                 f"Restore it from the launch (RunConfig.save) or remove the "
                                 f"run directory") from None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("world_size"), int):
            raise CorruptRunFile(f"{path} is not a dlab run config (a JSON object with an integer "
                                 f"world_size); restore it or remove the run directory")
        return cfg

    def world_size(self) -> int:
        return int(self.config().get("world_size", 0))

    def ranks(self) -> list[int]:
        return list(range(self.world_size()))

    def metrics(self, rank: int) -> list[dict]:
        """One record per step. After a restart a step may have run twice; the later attempt,
        the one the run went on from, is kept."""
        by_step = {m["step"]: m for m in JsonlTail(self.metrics_file(rank)).read()}
        return [by_step[s] for s in sorted(by_step)]

    def timeline(self, rank: int) -> list[dict]:
        return JsonlTail(self.timeline_file(rank)).read()

    def report(self, rank: int) -> dict | None:
        return read_json_object(self.report_file(rank))

    def log(self, rank: int) -> str:
        try:
            return self.log_file(rank).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def status(self) -> dict:
        """The launcher's final status when there is one; otherwise what the ranks' own reports
        say (a run started by torchrun or Slurm has no launcher to write status.json).

        A run with neither a final status nor every report is "running" while any of its
        processes may be alive, and "lost" once they are known gone: the launcher was killed
        (kill -9, a killed kernel) before it could write status.json. Known gone means: the
        torchrun of ``launch.json`` and every rank that wrote ``ranks/rank{r}.pid`` ran on this
        host and no such process is alive now (a live pid counts only if its command line names
        this run directory, so a reused pid does not). Processes on another host cannot be
        checked from here: such a run stays "running"."""
        final = read_json_object(self.path / "status.json")
        if final:
            return final
        reports = {r: self.report(r) for r in self.ranks()}
        failed = {r: rep for r, rep in reports.items() if rep and not rep.get("ok")}
        if failed:
            return {"state": "failed", "ranks": reports}
        if reports and all(rep and rep.get("ok") for rep in reports.values()):
            return {"state": preempted_or_ok(reports), "ranks": reports}
        return {"state": "lost" if self._processes_gone() else "running", "ranks": reports}

    def rank_gone(self, rank: int) -> bool:
        """True when ``rank`` wrote its pid file on this host and that process is gone (killed,
        or exited); False while it runs, and where this host cannot tell."""
        known = read_json_object(self.pid_file(rank))
        return bool(known) and known.get("host") == socket.gethostname() and not self._alive(
            known.get("pid"))

    def discard_temporaries(self, wait_s: float = 30.0) -> None:
        """Remove what writes that never finished left: ``.NAME.PID.tmp`` (``write_json``)
        whose writer is gone, once it is (a rank stuck in a write to a hung file system dies of
        its SIGKILL only when the disk answers), waiting at most ``wait_s`` for the writers."""
        deadline = time.monotonic() + wait_s
        for tmp in self.path.rglob(".*.tmp"):
            pid = tmp.name.rsplit(".", 2)[-2]
            if not pid.isdigit():
                continue
            while _running(int(pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not _running(int(pid)):
                tmp.unlink(missing_ok=True)

    def _processes_gone(self) -> bool:
        here = socket.gethostname()
        known = [read_json_object(self.path / "launch.json")]
        known += [read_json_object(self.pid_file(r)) for r in self.ranks() if not self.report(r)]
        known = [k for k in known if k]
        if not known or any(k.get("host") != here for k in known):
            return False
        return not any(self._alive(k.get("pid")) for k in known)

    def _alive(self, pid) -> bool:
        try:
            p = psutil.Process(int(pid))
            return (p.status() != psutil.STATUS_ZOMBIE
                    and self.path.resolve().name in " ".join(p.cmdline()))
        except (psutil.Error, TypeError, ValueError):
            return False


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class RankWriter:
    """What one rank writes: metrics and timeline lines (flushed per step), and its final
    report. Opened lazily so a rank that fails early leaves only what it got to."""

    def __init__(self, run: RunDir, rank: int):
        self.run, self.rank = run, rank
        for sub in ("ranks", "metrics", "timeline", "logs"):
            (run.path / sub).mkdir(exist_ok=True)
        reserve(run.report_file(rank))
        try:
            self._metrics = open(run.metrics_file(rank), "a")
            self._timeline = open(run.timeline_file(rank), "a")
            write_json(run.pid_file(rank), {"pid": os.getpid(), "host": socket.gethostname()})
        except OSError as e:
            # A disk that takes nothing more (its log cannot be written either): said in the
            # space set aside for the report, the one record this rank can still leave, so the
            # run does not read "failed before any rank reported".
            error = disk_error(e, e.filename or run.pid_file(rank))
            with contextlib.suppress(OSError):
                self.report(ok=False, step=None, exception=type(error).__name__,
                            message=str(error), traceback="")
            raise error from None

    def metric(self, record: dict) -> None:
        self._append(self._metrics, json.dumps(record) + "\n")

    def events(self, records: list[dict]) -> None:
        if records:
            self._append(self._timeline, "".join(json.dumps(r) + "\n" for r in records))

    @staticmethod
    def _append(file, text: str) -> None:
        try:
            file.write(text)
            file.flush()
        except OSError as e:
            raise disk_error(e, file.name) from None

    def report(self, **fields) -> None:
        write_json(self.run.report_file(self.rank),
                   {"rank": self.rank, "pid": os.getpid(), "time": time.time(), **fields})

    def close(self) -> None:
        self._metrics.close()
        self._timeline.close()
