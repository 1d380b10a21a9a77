"""Local SGD and DiLoCo beside PyTorch's model averaging and beside ddp: rows for a combined bench.

``rows(quick)`` launches, at 4 ranks (quick: 2, fewer steps), the model of ``dlab.bench.ddp``
(its gradients' all-reduce is a visible part of a step on this machine) for H = 1, 4, 16:
dlab's ``local-sgd`` averaging against PyTorch's ``PeriodicModelAverager`` (``torch-local-sgd``)
at the same H, ``local-sgd`` with DiLoCo's outer step (no PyTorch peer), and ``ddp`` once, all
on the same global batches (equal tokens). Rows, each ``{"name", "H", "ranks", "metric", "dlab"}``
and, where there is a peer, ``"peer"`` and ``"ratio"`` (``dlab.bench.compared``):

- ``bytes_per_step``: what a rank sent per step, averaged over the run (the ring model counted
  at each call), beside ``formula`` (``dlab.theory.local_sgd.mean_bytes_per_step``) and
  ``wire``, the all-reduce bytes measured on the transport per step (None off Gloo/Linux);
- ``step_s``: the mean step time after the first (each step's slowest rank). Not the
  summary's median: with H > 1 most steps do not sync, and the median would leave the sync out;
- ``final_loss``: the last step's logged loss (``run.summary()``), beside ``ddp``'s.
"""
from __future__ import annotations

import statistics
import tempfile

from dlab.bench import compared
from dlab.bench.ddp import BATCH, MODEL
from dlab.models import model_config
from dlab.procs.launch import launch
from dlab.theory import local_sgd as est

SYNC_EVERY = (1, 4, 16)


def _measure(strategy: str, world_size: int, steps: int, runs_dir: str, **options) -> dict:
    run = launch(strategy, world_size, runs_dir=runs_dir, wait=True, steps=steps,
                      batch_size=BATCH, model="gpt", model_options=MODEL, options=options)
    per_rank = [run.metrics(r) for r in range(world_size)]
    wire = [m["comm_by_op"].get("all_reduce", {}).get("wire_bytes") or 0 for m in per_rank[0]]
    return {"bytes_per_step": statistics.mean(m["comm"]["sent_bytes"] for m in per_rank[0]),
            "wire": statistics.mean(wire) if per_rank[0][0]["comm"]["wire_bytes"] is not None else None,
            "step_s": statistics.mean(max(ms[i]["step_time"] for ms in per_rank) for i in range(1, steps)),
            "final_loss": run.summary().rows[0]["loss"]}


def rows(quick: bool = False) -> list[dict]:
    n, steps = (2, 16) if quick else (4, 32)
    param_bytes = 4 * model_config("gpt", MODEL).n_params()
    out = []
    with tempfile.TemporaryDirectory(prefix="dlab-bench-local-sgd-") as runs_dir:
        ddp = _measure("ddp", n, steps, runs_dir)
        out += [{"name": "ddp", "H": 1, "ranks": n, "metric": metric, "dlab": ddp[metric]}
                for metric in ("bytes_per_step", "step_s", "final_loss")]
        for h in SYNC_EVERY:
            what = {"H": h, "ranks": n}
            formula = est.mean_bytes_per_step(param_bytes, n, h, steps)
            mine = _measure("local-sgd", n, steps, runs_dir, sync_every=h)
            peer = _measure("torch-local-sgd", n, steps, runs_dir, sync_every=h)
            diloco = _measure("local-sgd", n, steps, runs_dir, sync_every=h, outer="diloco")
            out += [
                compared(mine["bytes_per_step"], peer["bytes_per_step"], name="local-sgd", **what,
                         metric="bytes_per_step", formula=formula, wire=mine["wire"],
                         peer_wire=peer["wire"]),
                compared(mine["step_s"], peer["step_s"], name="local-sgd", **what, metric="step_s"),
                compared(mine["final_loss"], peer["final_loss"], name="local-sgd", **what,
                         metric="final_loss", ddp=ddp["final_loss"]),
                {"name": "diloco", **what, "metric": "bytes_per_step", "dlab": diloco["bytes_per_step"],
                 "formula": formula, "wire": diloco["wire"]},
                {"name": "diloco", **what, "metric": "step_s", "dlab": diloco["step_s"]},
                {"name": "diloco", **what, "metric": "final_loss", "dlab": diloco["final_loss"],
                 "ddp": ddp["final_loss"]},
            ]
    return out
