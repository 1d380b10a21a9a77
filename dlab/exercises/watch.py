"""What the distributed exercises share: each rank's inputs made from (rank, world) alone, the
per-rank comparison a judge reports by, and the wrappers that log what an answer calls on
``dist`` (``Exercise.watch``), so a judge can check how the answer communicates and not only
its result."""
from __future__ import annotations

import time

import torch

from dlab.exercises.registry import first_difference

WORLD = 4


def values(rank: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-9, 10, (n,), generator=g).float()


def per_rank(answers, want, what: str) -> str | None:
    for r, (got, exp) in enumerate(zip(answers, want)):
        wrong = first_difference(got, exp, what)
        if wrong:
            return f"rank {r}, {wrong}"
    return None


# --- watching what an answer calls ------------------------------------------------------------
#: the collectives a watched answer may call, by the name the judges use (torch 2.13's new names too)
KINDS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
          "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
          "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
          "all_gather_single": "all_gather", "broadcast": "broadcast", "gather": "gather",
          "reduce": "reduce"}


def flat(t) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in t]) if isinstance(t, (list, tuple)) else t


def outermost(on_call):
    """A wrapper factory whose wrappers call ``on_call(name, args, kwargs)`` for the learner's
    call only: torch 2.13's old names call the new ones, which are wrapped too."""
    depth = [0]

    def factory(name):
        def wrap(op):
            def watched(*args, **kwargs):
                if not depth[0]:
                    on_call(name, args, kwargs)
                depth[0] += 1
                try:
                    return op(*args, **kwargs)
                finally:
                    depth[0] -= 1
            return watched
        return wrap
    return factory


class _WaitLogged:
    """An async op's handle that logs when the answer first waits for it (``waited``)."""

    def __init__(self, work, call: dict):
        self._work, self._call = work, call

    def wait(self, *args, **kwargs):
        self._call.setdefault("waited", time.perf_counter())
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def log_collectives(log):
    """Wrap the collectives to log each call: its kind, the elements it took in, when it was
    called (``t``) and, for an async one, when the answer first waited for it (``waited``), and,
    kept as a reference (read when the answer has returned, so async ops have finished), what
    it wrote."""
    log["calls"] = []

    def on_call(name, args, kwargs):
        kind = KINDS[name]
        out, inp = (args + (None, None))[:2]
        if kind in ("all_reduce", "broadcast", "reduce", "gather"):
            inp = out
        log["calls"].append({"kind": kind, "out": out, "async": bool(kwargs.get("async_op")),
                             "in_numel": 0 if inp is None else flat(inp).numel(),
                             "t": time.perf_counter()})
    factory = outermost(on_call)

    def handles_logged(name):
        def wrap(op):
            watched = factory(name)(op)

            def call(*args, **kwargs):
                before = len(log["calls"])
                work = watched(*args, **kwargs)
                if work is not None and kwargs.get("async_op") and len(log["calls"]) > before:
                    return _WaitLogged(work, log["calls"][before])
                return work
            return call
        return wrap
    return {name: handles_logged(name) for name in KINDS}
