"""Per-rank timeline events, on a clock shared by all ranks.

Each rank starts its clock right after a barrier (``align``), so event times on different
ranks are comparable to within the barrier's release skew (well under a millisecond on one
host). Events are plain dicts - ``kind``, ``step``, ``start``, ``end`` in seconds, plus ``mb``
(micro-batch) and ``stage`` where they apply - so a schedule simulator can produce the same
shape and the dashboard draws both the same way. Bubble fraction = idle / makespan.
"""
from __future__ import annotations

import time
from contextlib import contextmanager


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.step = 0
        self.events: list[dict] = []

    def align(self) -> float:
        """Call right after a barrier: restarts the clock, returns the wall time it reads as 0."""
        self.t0 = time.perf_counter()
        return time.time()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, kind: str, start: float, end: float, **fields) -> None:
        self.events.append({"kind": kind, "step": self.step, "start": start, "end": end, **fields})

    @contextmanager
    def span(self, kind: str, **fields):
        start = self.now()
        try:
            yield
        finally:
            self.add(kind, start, self.now(), **fields)

    def drain(self) -> list[dict]:
        out, self.events = self.events, []
        return out


#: the spans in which a rank does its own work; the rest of a step it waits (for a peer, for
#: bytes). An injected straggler's delay counts as its own work: it is the slow rank's time.
BUSY_KINDS = ("forward", "backward", "weight_grad", "optimizer", "straggle")
#: the computations of a pipeline's schedule (its bubble is the time a rank does none of them)
COMPUTE = ("forward", "backward", "weight_grad")


def union(spans) -> list[tuple[float, float]]:
    """The ``(start, end)`` spans merged where they overlap or touch, in time order: the one
    span union every measure of busy, hidden or exposed time is built on."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(spans) -> float:
    """Seconds covered by at least one of ``spans`` (overlapping spans counted once)."""
    return sum(e - s for s, e in union(spans))


def overlap(a, b) -> float:
    """Seconds covered by both the spans ``a`` and the spans ``b``."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in union(a) for s2, e2 in union(b))


def comm_times(comm, blocked, compute, window: tuple[float, float]) -> tuple[float, float]:
    """(exposed, busy) seconds of one rank's communication in one step.

    ``comm``: the spans in which some collective of the rank was in flight (launch to
    completion); ``blocked``: the spans in which the rank could do nothing but wait for one (a
    blocking call, or a ``wait()`` on an async one); ``compute``: its own work (``BUSY_KINDS``),
    whose spans may contain blocked ones (a tensor-parallel forward waits inside its
    all-reduce); ``window``: the step, to which every span is clipped.

    busy = |C|, the union of the collectives' spans: the time the network had work, counted once
    however many collectives overlap (their plain sum can exceed the step, as a DDP step whose
    buckets all wait for the same wire shows). exposed = |C \\ (K \\ S)|, the part of it no
    computation covers, with K the compute spans and S the blocked ones (taken into C, as a
    rank waiting on a collective is communicating); as S lies in C it is
    |C| - |C & K| + |K & S|. So exposed <= busy <= the window, whatever overlaps."""
    lo, hi = window
    clip = lambda xs: [(max(s, lo), min(e, hi)) for s, e in xs if min(e, hi) > max(s, lo)]  # noqa: E731
    c, s, k = clip(list(comm) + list(blocked)), clip(blocked), clip(compute)  # S inside C
    busy = covered(c)
    return busy - overlap(c, k) + overlap(k, s), busy


def spans(events: list[dict], kinds) -> list[tuple[float, float]]:
    return [(e["start"], e["end"]) for e in events if e["kind"] in kinds]


def busy_seconds(events: list[dict], kinds=BUSY_KINDS) -> float:
    """Seconds of one rank's own work (``kinds``, nested spans once)."""
    return covered(spans(events, kinds))
