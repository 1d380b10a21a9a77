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
start clean). If a cell hangs, runs past ``--timeout`` or is interrupted, or a rank dies, the
pool restarts and the error says so. Bad arguments (``-n 0``, ``--timeout nan``, a runs
directory that is a file) are refused before anything is sent or stopped.
"""
from __future__ import annotations

import time
from pathlib import Path

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from dlab.core.config import ConfigError
from dlab.procs.cells import run_cell
from dlab.procs.launch import check_runs_dir, check_seconds
from dlab.procs.pool import RankPool, check_pool


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
        args = parse_argstring(self.dist_start, line)
        # every argument is checked before the running pool is stopped
        check_runs_dir(args.runs_dir)
        check_pool(args.nprocs, args.timeout, Path(args.runs_dir) / "pool")
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
        _check_cell_args(args)
        pool = None if args.fresh else DistributedMagics.pool
        if pool is not None and args.nprocs not in (None, pool.nprocs):
            raise ValueError(f"the warm pool has {pool.nprocs} ranks, the cell asks for "
                             f"{args.nprocs}: use %dist_start -n {args.nprocs}, or --fresh")
        if pool is not None:
            outputs, results, error = pool.run(cell, args.timeout)
        else:
            nprocs = 2 if args.nprocs is None else args.nprocs
            outputs, results, error = run_cell(cell, nprocs, args.timeout, args.runs_dir)
        display(outputs)
        if args.out and results is not None:
            self.shell.user_ns[args.out] = results
        if error is not None:
            raise error


def _check_cell_args(args) -> None:
    """Refuse a cell's bad arguments before anything is sent to a rank or started."""
    if args.nprocs is not None and args.nprocs < 1:
        raise ConfigError(f"-n {args.nprocs}: a cell runs on at least 1 rank; use -n 2, for example")
    check_seconds(args.timeout, "--timeout (the cell's deadline)")
    if args.out is not None and not args.out.isidentifier():
        raise ConfigError(f"-o {args.out}: not a Python variable name; use -o results, for example")


def register_magics(ipython) -> None:
    ipython.register_magics(DistributedMagics)
