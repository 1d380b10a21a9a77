"""Which rank broke a run, and why, from what the run directory holds.

When one rank fails, the others usually fail right after it (their peer's socket closed, or
their collective timed out), so "the first error" is not simply the earliest report. The cause
is the earliest of:

1. a rank that raised an error of its own (not a symptom of a peer going away); a rank whose
   step watchdog caught it stuck outside any collective (``StepDeadline``) is such a cause,
   and it is named before the ranks that timed out waiting for it in a collective;
2. a rank that died without a report (killed by a signal, or an exit) - torchrun's failure
   table in ``torchrun.log`` gives its exit code and when torchrun saw it end (to the
   second: such a death wins a tie with an error of the same second, which it likely caused).
   A rank torchrun ended itself (its closing SIGTERM, or the SIGKILL that follows when the
   rank ignores that) is a casualty of the teardown, never a cause while there is another;

otherwise the earliest report (e.g. every rank timed out at the deadline).
"""
from __future__ import annotations

import re
import shutil
import signal
from dataclasses import dataclass
from datetime import datetime

from dlab.core.disk import ELSEWHERE, RESERVED_BYTES
from dlab.core.rundir import RunDir, read_json_object

PEER_GONE = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
             "connection refused", "socket", "peer", "aborted")
#: one entry of torchrun's failure table (its time is torchrun's local time, to the second)
_TORCHRUN_FAILURE = re.compile(r"(?:time\s*:\s*(\S+)\s*\n[^\n]*\n\s*)?rank\s*:\s*(\d+)\s*"
                               r"\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")
#: torchrun's agent tearing the ranks down after a failure (it logs each pid it signals, and with
#: which signal)
_CLOSING = re.compile(r"(?:Sending process (\d+) closing signal|Closing process (\d+) via signal) "
                      r"(SIG[A-Z]+)")
#: and the SIGKILL that follows when a rank ignores the closing SIGTERM
_FORCED = re.compile(r"Unable to shutdown process (\d+) via \d+,\s*forcefully exiting via (\d+)")
_FIRST = "Root Cause (first observed failure)"


class RunFailed(RuntimeError):
    """A run ended because a rank failed. ``rank``, ``exception``, ``message``, ``traceback``
    and ``exit_codes`` hold the details; ``str()`` is what a person needs to read."""

    def __init__(self, run: RunDir, rank: int | None, *, exception: str = "", message: str = "",
                 traceback: str = "", step: int | None = None, exit_code: int | None = None,
                 hint: str = "", exit_codes: dict | None = None, log_tail: str = "",
                 unreported: list[int] | None = None):
        self.unreported = unreported or []  # ranks stopped at the teardown before they reported
        self.run, self.rank, self.exception, self.message = run, rank, exception, message
        self.traceback, self.step, self.exit_code, self.hint = traceback, step, exit_code, hint
        self.exit_codes, self.log_tail = exit_codes or {}, log_tail
        super().__init__(self._text())

    def _text(self) -> str:
        world = self.run.world_size()
        where = f" at step {self.step}" if self.step is not None else ""
        if self.rank is None:
            head = f"the run failed before any rank reported (torchrun exit code {self.exit_code})"
        elif self.exception:
            head = f"rank {self.rank} of {world} failed{where}: {self.exception}: {self.message}"
        elif self.exit_code is not None and self.exit_code < 0:
            name = signal.Signals(-self.exit_code).name
            head = (f"rank {self.rank} of {world} was killed by {name}{where} (exit code "
                    f"{self.exit_code}); a killed process cannot leave a traceback")
        else:
            head = (f"rank {self.rank} of {world} exited with code {self.exit_code}{where} "
                    f"without raising an exception")
        parts = [head]
        if self.hint:
            parts.append(f"hint: {self.hint}")
        if self.traceback:
            parts.append("traceback (last lines):\n" + _tail(self.traceback, 12))
        elif self.log_tail:
            parts.append("its output (last lines):\n" + self.log_tail)
        log = f"logs/rank{self.rank}.log" if self.rank is not None else "torchrun.log"
        parts.append(f"run directory: {self.run.path}  (full output: {log})")
        return "\n".join(parts)


def _tail(text: str, n: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def own_error(report: dict) -> bool:
    """Whether a rank's failure is its own (a cause) rather than a symptom of a peer that went
    away or never joined (a closed connection, a collective's timeout)."""
    if report.get("in_torch"):  # its watchdog found it inside torch: maybe waiting on a peer
        return False
    text = f"{report.get('exception', '')} {report.get('message', '')}".lower()
    return not any(p in text for p in PEER_GONE)


@dataclass(frozen=True)
class Ended:
    """A failed rank as torchrun's failure table lists it, or as the keeper of a forked rank
    recorded its end (``dlab.procs.agent``: exact where the table has a second)."""
    exit_code: int
    seen: float  # when it was seen to end (seconds since the epoch; torchrun's to the second; inf: not said)
    first: bool  # torchrun's "Root Cause (first observed failure)"
    # torchrun's closing signal ended it: a casualty. It sends that signal to every rank it still
    # lists, including one that has just exited on its own (torchrun had not seen it yet): that
    # rank's exit code is its own, not the signal's, and it stays a cause
    torn_down: bool


def torchrun_failures(run: RunDir) -> dict[int, Ended]:
    """The failed ranks of torchrun's failure table, by rank; where a forked rank's keeper
    recorded the end, that record (torch's agent lists only the first failure of a forked run)."""
    text = _read(run / "torchrun.log")
    closed: dict[int, set[int]] = {}  # pid: the exit codes torchrun's signals to it would give
    for pid, forked_pid, name in _CLOSING.findall(text):
        closed.setdefault(int(pid or forked_pid), set()).add(-getattr(signal, name, signal.SIGTERM))
    for pid, number in _FORCED.findall(text):
        closed.setdefault(int(pid), set()).add(-int(number))
    first_at = text.find(_FIRST)
    out = {}
    for m in _TORCHRUN_FAILURE.finditer(text):
        when, rank, code, pid = m.groups()
        out[int(rank)] = Ended(int(code), _seconds(when), 0 <= first_at < m.start(),
                               pid is not None and int(code) in closed.get(int(pid), ()))
    # a forked rank's keeper saw its end exactly (dlab.procs.agent); one ended by a signal passed
    # on to it counts as torchrun's table would count it: torn down in a run torchrun saw fail,
    # not listed in a run stopped from outside (torchrun writes no table then)
    for r in run.ranks():
        end = read_json_object(run.exit_file(r))
        if end and isinstance(end.get("exit_code"), int) and (first_at >= 0 or not end.get("torn_down")):
            out[r] = Ended(end["exit_code"], float(end.get("time", float("inf"))), False,
                           bool(end.get("torn_down")))
    return out


def _seconds(when: str | None) -> float:
    try:
        return datetime.strptime(when or "", "%Y-%m-%d_%H:%M:%S").timestamp()
    except ValueError:
        return float("inf")


def torchrun_exit_codes(run: RunDir) -> dict[int, int]:
    """Exit codes of failed ranks as torchrun's failure table lists them."""
    return {r: ended.exit_code for r, ended in torchrun_failures(run).items()}


def _last_step(run: RunDir, rank: int) -> int | None:
    metrics = run.metrics(rank)
    return metrics[-1]["step"] + 1 if metrics else None


def find_failure(run: RunDir, torchrun_exit: int | None = None) -> RunFailed | None:
    reports = {r: run.report(r) for r in run.ranks()}
    ended = torchrun_failures(run)
    listed = {r: e.exit_code for r, e in ended.items()}
    exit_codes: dict[int, int | None] = {}
    for r, rep in reports.items():
        exit_codes[r] = 0 if rep and rep.get("ok") else listed.get(r, 1 if rep else None)
    raised = {r: rep for r, rep in reports.items() if rep and not rep.get("ok")}
    silent = [r for r in reports if not reports[r] and listed.get(r, 0) != 0]
    # A rank torchrun itself ended (SIGTERM, or SIGKILL once it ignored that: a checkpointing
    # rank takes SIGTERM for a notice) is a casualty of the teardown, not a cause.
    stopped = [r for r in silent if listed[r] == -signal.SIGTERM or ended[r].torn_down]
    silent = [r for r in silent if r not in stopped]
    if not raised and not silent:
        silent = stopped
    if not raised and not silent:
        if torchrun_exit and not any(reports.values()):
            return RunFailed(run, None, exit_code=torchrun_exit, exit_codes=exit_codes,
                             log_tail=_tail(_read(run / "torchrun.log"), 15),
                             hint=_full_disk(run))
        return None

    # the earliest cause; at one time a death without a report before an error, torchrun's
    # first observed failure before the others
    causes = sorted([(ended[r].seen, 0 if ended[r].first else 1, r) for r in silent]
                    + [(rep.get("time", 0.0), 2, r) for r, rep in raised.items() if own_error(rep)])
    if causes:
        r = causes[0][2]
    else:
        r = min((rep.get("time", 0.0), r) for r, rep in raised.items())[1]
    rep = raised.get(r)
    if rep:
        hint = rep.get("hint", "")
        if hint and stopped:
            hint += (f" Rank(s) {stopped} made no report and were stopped at the teardown: "
                     f"the likely stuck one(s).")
        return RunFailed(run, r, exception=rep.get("exception", "an error"),
                         message=rep.get("message", ""), traceback=rep.get("traceback", ""),
                         step=rep.get("step"), exit_code=exit_codes[r],
                         hint=hint, exit_codes=exit_codes, unreported=stopped)
    return RunFailed(run, r, step=_last_step(run, r), exit_code=listed[r], exit_codes=exit_codes,
                     log_tail=_tail(run.log(r), 8))


def _full_disk(run: RunDir) -> str:
    """Why nothing reported, when the disk is full: not even the ranks' logs or torchrun's
    could be written then, and the free space is the one thing left to read."""
    try:
        free = shutil.disk_usage(run.path).free
    except OSError:
        return ""
    if free >= RESERVED_BYTES * (run.world_size() + 1):
        return ""
    return (f"the file system of {run.path} has {free // 1024} KiB free: a full disk is the "
            f"likely cause (no rank could write its log or report); free some space there, or "
            f"{ELSEWHERE}")


def _read(path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
