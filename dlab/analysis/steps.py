"""What a run's records say about its steps: every per-step reduction the summary, the
figures and the benches read, each defined once here.

- The steps that count (``steady``): every step after the first ``WARMUP`` (the first pays for
  lazy initialisation: allocator, Gloo's connections, autograd's graph), or all of them when
  there are no more.
- Step time (``step_time``): each rank's median over the steady steps, then the slowest rank (a
  synchronous step is not over until every rank is). Every bench and notebook that times a run
  uses it.
- Bytes on the wire per step (``wire_per_step``): a rank's median over the steady steps, None
  where any of them could not be measured (``dlab.comm.wire``).
- Memory (``peak_memory``): each category's peak over every step, the first included (its
  allocations are real).
- The pipeline bubble (``bubble_fractions``): per rank, the mean over the steady steps of the
  part of each step's window in which the rank computes nothing.
- How much communication the computation hid (``comm_overlap``).
"""
from __future__ import annotations

from statistics import median

from dlab.core.events import COMPUTE, busy_seconds, covered, overlap, spans
from dlab.core.metrics import CATEGORIES

WARMUP = 1


def steady(records: list, warmup: int = WARMUP) -> list:
    """The steps that count (module docstring): ``records`` after the first ``warmup``."""
    return records[warmup:] or records


def step_time(run, warmup: int = WARMUP) -> float:
    """The run's step time in seconds (module docstring)."""
    return max(median([m["step_time"] for m in steady(run.metrics(r), warmup)])
               for r in range(run.world_size))


def wire_per_step(records: list[dict]) -> float | None:
    """A rank's median bytes measured on the wire per steady step; None if any was not measured."""
    wire = [m["comm"].get("wire_bytes") for m in steady(records)]
    return median(wire) if wire and None not in wire else None


def peak_memory(records: list[dict]) -> dict[str, float]:
    """Each memory category's peak over a rank's steps."""
    return {c: max((m["memory"].get(c, 0) for m in records), default=0) for c in CATEGORIES}


def bubble_fractions(events: list[dict]) -> dict[int, float]:
    """Mean bubble fraction per rank over the steady steps: for one step the window runs from
    the first computation on any rank to the last one, and a rank's bubble is the part of that
    window in which it computes nothing (GPipe, Huang et al. 2019; 1F1B, Narayanan et al.
    2019). ``events`` are timeline events of all ranks, each with ``rank``."""
    by_step: dict[int, dict[int, list[dict]]] = {}
    for e in events:
        if e["kind"] in COMPUTE:
            by_step.setdefault(e["step"], {}).setdefault(e["rank"], []).append(e)
    out: dict[int, list[float]] = {}
    for s in steady(sorted(by_step)):
        ranks = by_step[s]
        start = min(e["start"] for evs in ranks.values() for e in evs)
        end = max(e["end"] for evs in ranks.values() for e in evs)
        if end <= start:
            continue
        for r, evs in ranks.items():
            out.setdefault(r, []).append(1 - busy_seconds(evs, COMPUTE) / (end - start))
    return {r: sum(v) / len(v) for r, v in sorted(out.items())}


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
