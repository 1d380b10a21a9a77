"""Run notebooks top to bottom and report the CPU-seconds each one costs: the figure that sizes
a hub (docs/instructor/hub.md), since 30 learners running a notebook at once need its
CPU-seconds, not its wall time, times 30, from the machine's cores.

    .venv/bin/python tests/notebook_cpu_seconds.py notebooks/00_start_here.ipynb ...

Each notebook runs in a fresh kernel (nbclient), nothing is written back. CPU-seconds are
``resource.getrusage(RUSAGE_CHILDREN)`` (user + system) before and after: the kernel is this
process's child and is reaped when the notebook ends, and the ranks, torchrun and the warm pool
it started are its children, reaped by it, so their time is in the kernel's figure. This
process's own time (nbclient's messaging) is added from ``RUSAGE_SELF``. On a busy machine the
wall time stretches; the CPU-seconds much less so.
"""
from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def cpu_seconds() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def measure(path: Path, timeout: int = 1200) -> dict:
    """Run ``path`` once; its CPU-seconds (the kernel and everything it started) and wall
    seconds."""
    nb = nbformat.read(path, as_version=4)
    cpu, wall = cpu_seconds(), time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return {"notebook": path.name, "cpu_s": cpu_seconds() - cpu, "wall_s": time.perf_counter() - wall}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1])
        return 2
    print(f"{'notebook':34s} {'CPU s':>7s} {'wall s':>7s}", flush=True)
    for arg in argv:
        row = measure(Path(arg).resolve())
        print(f"{row['notebook']:34s} {row['cpu_s']:7.1f} {row['wall_s']:7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
