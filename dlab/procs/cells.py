"""A notebook cell run on ranks, and what comes back: each rank's output side by side
(``RankOutputs``), the failing rank's error with the lines of the cell it came from
(``RankError``), and ``run_cell``, a cell on N fresh ranks (``dlab.spawn``). The warm pool
(``dlab.procs.pool``) answers with the same types; ``%%distributed`` (``dlab.tools.magic``)
shows them.
"""
from __future__ import annotations

import html
import re
import time
import uuid
from pathlib import Path

from dlab.analysis.diagnose import RunFailed
from dlab.core.rundir import RunDir
from dlab.procs.spawn import spawn

_CELL_FRAME = re.compile(r'File "<cell>", line (\d+)')


class RankError(RuntimeError):
    """A ``%%distributed`` cell failed on ``rank``. IPython shows ``_render_traceback_`` in
    place of the magic's own (uninteresting) stack."""

    def __init__(self, rank: int | None, exception: str, message: str, cell_traceback: str,
                 run_dir: Path, logs: str | None = None):
        self.rank, self.exception, self.message = rank, exception, message
        self.cell_traceback, self.run_dir = cell_traceback, run_dir
        self.logs = logs or f"{run_dir}/logs/rank{{r}}.log"
        who = f"rank {rank}" if rank is not None else "the cell's run"
        super().__init__(f"{who} raised {exception}: {message}" if exception
                         else f"{who} failed: {message}")

    def _render_traceback_(self) -> list[str]:
        red, bold, reset = "\x1b[31m", "\x1b[1m", "\x1b[0m"
        lines = [f"{red}{bold}%%distributed: {self}{reset}"]
        if self.cell_traceback:
            lines += ["", self.cell_traceback]
        lines += ["", f"full logs: {self.logs}"]
        return lines


def cell_traceback(traceback: str, cell: str) -> str:
    """The part of a rank's traceback that is in the user's cell, with the cell's source lines
    put back (code run from a string has no file for the traceback module to quote)."""
    lines = traceback.rstrip().splitlines()
    first = next((i for i, line in enumerate(lines) if line.lstrip().startswith('File "<cell>"')),
                 None)
    if first is None:
        return "\n".join(lines[-6:])
    source = cell.splitlines()
    out = ["Traceback (most recent call last, in the cell):"]
    for line in lines[first:]:
        out.append(line)
        m = _CELL_FRAME.search(line)
        if m and 0 < int(m.group(1)) <= len(source):
            out.append("    " + source[int(m.group(1)) - 1].strip())
    return "\n".join(out)


class RankOutputs:
    """What each rank printed (and its ``result``), side by side in HTML, one block after the
    other as text."""

    def __init__(self, logs: list[str], results: list | None, failed_rank: int | None,
                 summary: str):
        self.logs, self.results, self.failed_rank, self.summary = logs, results, failed_rank, summary

    def _result(self, r: int) -> str | None:
        if self.results is None or self.results[r] is None:
            return None
        return f"result = {self.results[r]!r}"

    def __repr__(self) -> str:
        blocks = []
        for r, log in enumerate(self.logs):
            mark = "  <- raised" if r == self.failed_rank else ""
            body = [log.rstrip()] if log.strip() else []
            if (res := self._result(r)) is not None:
                body.append(res)
            blocks.append(f"--- rank {r}{mark} ---\n" + "\n".join(body))
        return "\n".join(blocks + [self.summary])

    def _repr_html_(self) -> str:
        cols = []
        for r, log in enumerate(self.logs):
            failed = r == self.failed_rank
            head = f"rank {r}" + (" &mdash; raised" if failed else "")
            res = self._result(r)
            cols.append(
                f"<div style='flex:1;min-width:180px;border:1px solid {'#d62728' if failed else '#ccc'};"
                f"border-radius:4px;margin:2px'><div style='background:{'#fbe3e3' if failed else '#f0f0f0'};"
                f"padding:2px 6px;font-weight:bold'>{head}</div>"
                f"<pre style='margin:0;padding:4px 6px;font-size:12px;white-space:pre-wrap'>"
                f"{html.escape(log.rstrip())}</pre>"
                + (f"<pre style='margin:0;padding:2px 6px;font-size:12px;color:#555;"
                   f"border-top:1px dashed #ccc'>{html.escape(res)}</pre>" if res else "")
                + "</div>")
        return (f"<div style='display:flex;flex-wrap:wrap'>{''.join(cols)}</div>"
                f"<div style='color:#555;font-size:12px'>{html.escape(self.summary)}</div>")


def rank_output(run: RunDir, rank: int) -> str:
    """What ``rank`` printed, without the traceback the worker adds when the rank fails (the
    failing rank's is shown as the cell's error; the others' only say a peer went away)."""
    log, report = run.log(rank), run.report(rank)
    if not report or report.get("ok"):
        return log
    printed = log[:log.rfind("Traceback (most recent call last):")] if "Traceback" in log else log
    why = (report.get("message") or "").strip().splitlines()[:1]
    return printed + f"[ended by {report.get('exception')}: {why[0] if why else ''}]"


def run_cell(cell: str, nprocs: int, timeout_s: float = 60.0, runs_dir: str | Path = "runs"):
    """Run ``cell`` on ``nprocs`` ranks. Returns (RankOutputs, results or None, RankError or
    None); this is the magic without IPython, for tests and scripts."""
    root = Path(runs_dir) / "distributed"
    name = f"cell-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    results, error = None, None
    try:
        results = spawn(cell, nprocs, runs_dir=root, name=name, timeout_s=timeout_s)
    except RunFailed as failure:
        error = failure
    run = RunDir(next(root.glob(f"*-{name}")))
    elapsed = time.monotonic() - start
    logs = [rank_output(run, r) for r in range(nprocs)]
    summary = (f"{nprocs} ranks, {elapsed:.1f} s including process start-up; "
               f"run directory {run.path}")
    if error is None:
        return RankOutputs(logs, results, None, summary), results, None
    summary = ("FAILED: " + (f"rank {error.rank} raised" if error.rank is not None else
                             "the run failed before any rank reported") + "; " + summary)
    rank_error = RankError(error.rank, error.exception, error.message or str(error).splitlines()[0],
                           cell_traceback(error.traceback, cell) if error.traceback else
                           error.log_tail, run.path)
    return RankOutputs(logs, None, error.rank, summary), None, rank_error
