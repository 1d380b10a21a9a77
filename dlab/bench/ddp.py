"""``python -m dlab bench ddp``: dlab's data parallelism against PyTorch's DDP.

Same model, global batch and ranks for every row; each configuration is one ``dlab.launch``
and its summary's median step time (steps after the first). Rows: ``dp-naive`` and ``ddp`` at
several bucket caps, each beside PyTorch's ``DistributedDataParallel`` launched for that row
at the same bucket cap (``torch-ddp`` with ``comm_hook="builtin"``: DDP's own C++ all-reduce,
no Python hook; ``dp-naive`` has no buckets and stands beside PyTorch's default 25 MiB):
``ratio`` = dlab step time / PyTorch's, the target for ``ddp`` being <= 1.10. Beside it, from
the timeline: ``comm_ms``, the wall time per step some all-reduce was in flight, and
``hidden``, the fraction of that time that overlapped backward (communication hidden behind
computation). There is no such figure for PyTorch: its built-in reducer's all-reduces do not
show on dlab's timeline.
"""
from __future__ import annotations

import statistics
import tempfile

from dlab.bench import compared

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 64}
BATCH = 16


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(spans) -> float:
    return sum(e - s for s, e in spans)


def _intersection(a, b) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def comm_overlap(events: list[dict]) -> tuple[float, float]:
    """(seconds some all-reduce was in flight, the part of it inside backward) over the given
    events of one rank, step by step."""
    comm = hidden = 0.0
    for step in sorted({e["step"] for e in events}):
        ev = [e for e in events if e["step"] == step]
        reduces = _union([(e["start"], e["end"]) for e in ev if e["kind"] == "all_reduce"])
        backward = _union([(e["start"], e["end"]) for e in ev if e["kind"] == "backward"])
        comm += _length(reduces)
        hidden += _intersection(reduces, backward)
    return comm, hidden


def measure(strategy: str, world_size: int, options: dict, steps: int, runs_dir: str) -> dict:
    import dlab
    run = dlab.launch(strategy, world_size, runs_dir=runs_dir, wait=True, steps=steps,
                      batch_size=BATCH, model="gpt", model_options=MODEL, options=options)
    rows = run.summary().rows
    comm = hidden = 0.0
    for rank in range(world_size):
        c, h = comm_overlap([e for e in run.timeline(rank) if e["step"] > 0])
        comm, hidden = comm + c, hidden + h
    return {"step_s": max(r["step_time_s"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "comm_ms": 1e3 * comm / world_size / (steps - 1),
            "hidden": hidden / comm if comm else 0.0}


def run(quick: bool = False) -> list[dict]:
    ranks = (2,) if quick else (2, 4)
    caps = (1, 25) if quick else (0.25, 1, 4, 25)
    steps = 6 if quick else 16
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlab-bench-ddp-") as runs_dir:
        for n in ranks:
            configs = [("dp-naive", {}, "-")] + [("ddp", {"bucket_cap_mb": c}, c) for c in caps]
            for strategy, options, cap in configs:
                # the peer at the same bucket cap (dp-naive, which has none: PyTorch's 25 MiB)
                peer = measure("torch-ddp", n, {"comm_hook": "builtin",
                                                "bucket_cap_mb": 25 if cap == "-" else cap},
                               steps, runs_dir)
                m = measure(strategy, n, options, steps, runs_dir)
                rows.append(compared(m["step_s"], peer["step_s"], strategy=strategy, ranks=n,
                                     bucket_mb=cap, metric="step_time_s",
                                     tokens_per_s=round(m["tokens_per_s"]),
                                     peer_tokens_per_s=round(peer["tokens_per_s"]),
                                     comm_ms=m["comm_ms"], hidden=m["hidden"]))
    return rows
