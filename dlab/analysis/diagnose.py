"""Which rank broke a run, and why, from what the run directory holds.

When one rank fails, the others usually fail right after it (their peer's socket closed, or
their collective timed out), so "the first error" is not simply the earliest report. The cause
is chosen in this order:

1. a rank that raised an error of its own (not a symptom of a peer going away); a rank whose
   step watchdog caught it stuck outside any collective (``StepDeadline``) is such a cause,
   and it is named before the ranks that timed out waiting for it in a collective;
2. a rank that died without a report (killed by a signal, or an exit) - torchrun's failure
   table in ``torchrun.log`` gives its exit code;
3. otherwise the earliest report (e.g. every rank timed out at the deadline).
"""
from __future__ import annotations

import re
import shutil
import signal

from dlab.core.rundir import ELSEWHERE, RESERVED_BYTES, RunDir

PEER_GONE = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
             "connection refused", "socket", "peer", "aborted")
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)")


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


def torchrun_exit_codes(run: RunDir) -> dict[int, int]:
    """Exit codes of failed ranks as torchrun's failure table lists them."""
    try:
        text = (run / "torchrun.log").read_text(errors="replace")
    except FileNotFoundError:
        return {}
    return {int(r): int(code) for r, code in _TORCHRUN_FAILURE.findall(text)}


def _last_step(run: RunDir, rank: int) -> int | None:
    metrics = run.metrics(rank)
    return metrics[-1]["step"] + 1 if metrics else None


def find_failure(run: RunDir, torchrun_exit: int | None = None) -> RunFailed | None:
    reports = {r: run.report(r) for r in run.ranks()}
    listed = torchrun_exit_codes(run)
    exit_codes: dict[int, int | None] = {}
    for r, rep in reports.items():
        exit_codes[r] = 0 if rep and rep.get("ok") else listed.get(r, 1 if rep else None)
    raised = {r: rep for r, rep in reports.items() if rep and not rep.get("ok")}
    silent = [r for r in reports if not reports[r] and listed.get(r, 0) != 0]
    # A rank torchrun itself ended with SIGTERM is a casualty of the teardown, not a cause.
    stopped = [r for r in silent if listed[r] == -signal.SIGTERM]
    silent = [r for r in silent if r not in stopped]
    if not raised and not silent:
        silent = stopped
    if not raised and not silent:
        if torchrun_exit and not any(reports.values()):
            return RunFailed(run, None, exit_code=torchrun_exit, exit_codes=exit_codes,
                             log_tail=_tail(_read(run / "torchrun.log"), 15),
                             hint=_full_disk(run))
        return None

    own = sorted((rep.get("time", 0.0), r) for r, rep in raised.items() if own_error(rep))
    if own:
        r = own[0][1]
    elif silent:
        r = min(silent)
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
