"""What a run's timeline and metrics say about its steps: the one definition of a run's step
time, and how much of its communication the computation hid.

Step time: each rank's median over the steps after the first ``warmup`` (the first pays for
lazy initialisation), then the slowest rank (a synchronous step is not over until every rank
is). Every bench and notebook that times a run uses ``step_time``.
"""
from __future__ import annotations

from statistics import median

from dlab.core.events import covered, overlap, spans


def step_time(run, warmup: int = 1) -> float:
    """The run's step time in seconds (module docstring)."""
    return max(median([m["step_time"] for m in run.metrics(r)[warmup:] or run.metrics(r)])
               for r in range(run.world_size))


def comm_overlap(events: list[dict], comm=("all_reduce",), compute=("backward",)
                 ) -> tuple[float, float]:
    """(seconds some collective of ``comm`` was in flight, the part of it inside a ``compute``
    span) over the given events of one rank, step by step: what overlap hid."""
    total = hidden = 0.0
    for step in sorted({e["step"] for e in events}):
        ev = [e for e in events if e["step"] == step]
        total += covered(spans(ev, comm))
        hidden += overlap(spans(ev, comm), spans(ev, compute))
    return total, hidden
