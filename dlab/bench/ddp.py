"""``python -m dlab bench ddp``: dlab's data parallelism against PyTorch's DDP.

Same model, global batch and ranks for every row; each configuration is one ``dlab.launch``
and its summary's median step time (steps after the first). Rows: ``dp-naive`` and ``ddp`` at
several bucket caps, each beside PyTorch's ``DistributedDataParallel`` launched for that row
at the same bucket cap (``torch-ddp`` with ``comm_hook="builtin"``: DDP's own C++ all-reduce,
no Python hook; ``dp-naive`` has no buckets and stands beside PyTorch's default 25 MiB):
``ratio`` = dlab step time / PyTorch's, the target for ``ddp`` being <= 1.10. Beside it, from
the run's summary, means over ranks: ``comm_busy_ms``, the wall time per step some collective
was in flight (the union of their spans), and ``comm_exposed_ms``, the part of it no
computation covered (``dlab.core.events.comm_times``); from the timeline, ``hidden``, the
fraction of the all-reduces' time that overlapped backward (communication hidden behind
computation). There is no such figure for PyTorch: its built-in reducer's all-reduces do not
show on dlab's timeline.
"""
from __future__ import annotations

import statistics
import tempfile

from dlab.analysis.steps import comm_overlap, step_time
from dlab.bench import compared
from dlab.procs.launch import launch

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 64}
BATCH = 16


def measure(strategy: str, world_size: int, options: dict, steps: int, runs_dir: str) -> dict:
    run = launch(strategy, world_size, runs_dir=runs_dir, wait=True, steps=steps,
                      batch_size=BATCH, model="gpt", model_options=MODEL, options=options)
    rows = run.summary().rows
    comm = hidden = 0.0
    for rank in range(world_size):
        c, h = comm_overlap([e for e in run.timeline(rank) if e["step"] > 0])
        comm, hidden = comm + c, hidden + h
    return {"step_s": step_time(run),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "comm_busy_ms": 1e3 * statistics.mean(r["comm_busy_s_per_step"] for r in rows),
            "comm_exposed_ms": 1e3 * statistics.mean(r["comm_exposed_s_per_step"] for r in rows),
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
                                     comm_busy_ms=m["comm_busy_ms"],
                                     comm_exposed_ms=m["comm_exposed_ms"], hidden=m["hidden"]))
    return rows
