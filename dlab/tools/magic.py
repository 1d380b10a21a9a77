"""``%%distributed -n 4``: run a cell's code on N ranks, for teaching collectives without
writing a module; ``%dist_start -n 4`` first keeps the ranks warm between cells.

::

    %load_ext dlab

    %%distributed -n 4
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print(t)

Each rank is a new process (started by torchrun through ``dlab.spawn``) with the default process
group initialised and ``rank``, ``world_size``, ``dist`` and ``torch`` in scope; nothing else
of the notebook's namespace is there (pass values in the cell's text). Whatever each rank
prints is shown grouped by rank, side by side; a rank's ``result`` variable, if it sets one,
is shown under its output and ``-o NAME`` stores all of them (a list in rank order) in the
notebook as ``NAME``. If a rank raises, the cell fails with that rank's number, its exception
and the lines of the cell it came from; the run directory under ``runs/distributed/`` keeps
the full logs.

With a warm pool (``%dist_start -n 4``; ``%dist_restart``, ``%dist_stop``; ``dlab.procs.pool``),
``%%distributed`` runs on the pool's ranks instead: no start-up, and each rank's variables are
kept from cell to cell. ``--fresh`` runs one cell on new processes even then (a cell that must
start clean). If a cell hangs, runs past ``--timeout`` or is interrupted, the pool restarts.
"""
from __future__ import annotations

import html
import re
import time
import uuid
from pathlib import Path

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from dlab.analysis.diagnose import RunFailed
from dlab.core.rundir import RunDir

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
    from dlab.procs.spawn import spawn

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


@magics_class
class DistributedMagics(Magics):
    pool = None  # the warm pool, if one was started (``%dist_start``)

    @magic_arguments()
    @argument("-n", "--nprocs", type=int, default=2, help="number of ranks (default 2)")
    @argument("--timeout", type=float, default=60.0, help="start-up deadline in seconds")
    @argument("--runs-dir", default="runs", help="where the ranks' logs go (RUNS_DIR/pool)")
    @line_magic
    def dist_start(self, line: str):
        """Start N warm ranks (the process group initialised); ``%%distributed`` cells then
        run on them, keeping each rank's variables between cells."""
        from dlab.procs.pool import RankPool

        args = parse_argstring(self.dist_start, line)
        self.dist_stop("")
        start = time.monotonic()
        DistributedMagics.pool = RankPool(args.nprocs, args.timeout, Path(args.runs_dir) / "pool")
        print(f"{args.nprocs} ranks ready in {time.monotonic() - start:.1f} s; %%distributed "
              f"cells now run on them (--fresh for new processes), %dist_stop ends them")

    @line_magic
    def dist_stop(self, line: str):
        """End the warm pool's ranks."""
        if DistributedMagics.pool is not None:
            DistributedMagics.pool.close()
            DistributedMagics.pool = None

    @line_magic
    def dist_restart(self, line: str):
        """New ranks in place of the pool's (every variable lost): after a cell left them in a
        state you do not want."""
        if DistributedMagics.pool is None:
            raise RuntimeError("no warm pool to restart: start one with %dist_start -n N")
        DistributedMagics.pool.restart()
        print(f"{DistributedMagics.pool.nprocs} new ranks ready")

    @magic_arguments()
    @argument("-n", "--nprocs", type=int, default=None,
              help="number of ranks (default: the pool's, or 2)")
    @argument("--fresh", action="store_true",
              help="run on new processes even when a warm pool is running")
    @argument("-o", "--out", default=None,
              help="store every rank's `result` in this notebook variable (a list, rank order)")
    @argument("--timeout", type=float, default=60.0,
              help="deadline in seconds for the start-up and every collective (default 60)")
    @argument("--runs-dir", default="runs", help="where the cell's run directory goes")
    @cell_magic
    def distributed(self, line: str, cell: str):
        """Run this cell on N ranks with the process group initialised (rank, world_size, dist,
        torch in scope): the warm pool's if one is running, else fresh ones; show each rank's
        output grouped by rank."""
        args = parse_argstring(self.distributed, line)
        pool = None if args.fresh else DistributedMagics.pool
        if pool is not None and args.nprocs not in (None, pool.nprocs):
            raise ValueError(f"the warm pool has {pool.nprocs} ranks, the cell asks for "
                             f"{args.nprocs}: use %dist_start -n {args.nprocs}, or --fresh")
        if pool is not None:
            outputs, results, error = pool.run(cell, args.timeout)
        else:
            outputs, results, error = run_cell(cell, args.nprocs or 2, args.timeout, args.runs_dir)
        display(outputs)
        if args.out and results is not None:
            self.shell.user_ns[args.out] = results
        if error is not None:
            raise error


def register_magics(ipython) -> None:
    ipython.register_magics(DistributedMagics)
