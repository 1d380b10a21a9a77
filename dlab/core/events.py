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


def busy_fraction(events: list[dict], kinds: tuple[str, ...] = ("forward", "backward", "weight_grad")
                  ) -> tuple[float, float]:
    """(busy seconds, makespan) of one rank's compute events; bubble = 1 - busy / makespan."""
    spans = sorted((e["start"], e["end"]) for e in events if e["kind"] in kinds)
    if not spans:
        return 0.0, 0.0
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy, spans[-1][1] - spans[0][0]
