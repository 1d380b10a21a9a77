"""``python -m dlab bench cells``: what a ``%%distributed`` cell costs, warm pool against fresh
processes.

The cell is a trivial all-reduce (``t = torch.ones(1); dist.all_reduce(t)``), run through the
same functions the magic calls: ``magic.run_cell`` (fresh: torchrun, N new interpreters, torch
imported, rendezvous, process group, then the cell) and ``RankPool.run`` (warm: a message to
each rank, the all-reduce, the answers). Per-cell latency, median of repeats, at 2 and 4 ranks;
the peer is the fresh mode (what a cell cost before the pool), so the ratio is warm / fresh.
Also the pool's own start-up, paid once per ``%dist_start``.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from dlab.bench import compared, median
from dlab.procs.cells import run_cell
from dlab.procs.pool import RankPool

CELL = "t = torch.ones(1)\ndist.all_reduce(t)\nresult = t.item()"


def _timed(run, n: int) -> float:
    """Seconds ``run()`` takes to return the cell's outcome, checked: every rank's sum is n."""
    start = time.perf_counter()
    _, results, error = run()
    seconds = time.perf_counter() - start
    if error is not None or results != [float(n)] * n:
        raise RuntimeError(f"the bench cell failed at {n} ranks: {error or results}")
    return seconds


def run(quick: bool = False) -> list[dict]:
    rows = []
    fresh_repeats, warm_repeats = (2, 10) if quick else (5, 50)
    with tempfile.TemporaryDirectory() as root:
        for n in ((2,) if quick else (2, 4)):
            fresh = [_timed(lambda n=n: run_cell(CELL, n, runs_dir=root), n)
                     for _ in range(fresh_repeats)]
            start = time.perf_counter()
            with RankPool(n, log_dir=Path(root) / f"pool{n}") as pool:
                started = time.perf_counter() - start
                warm = [_timed(lambda p=pool: p.run(CELL), n) for _ in range(warm_repeats)]
            rows.append(compared(median(warm), median(fresh), name="all-reduce cell", ranks=n,
                                 metric="cell_s", warm_max_s=max(warm), fresh_repeats=fresh_repeats,
                                 warm_repeats=warm_repeats))
            rows.append({"name": "pool start-up", "ranks": n, "metric": "start_s", "dlab": started})
    return rows
