"""Gradient compression rows: ``ddp``'s ``compress`` methods beside PyTorch's hooks.

``rows(quick)`` is called by a combined bench (``python -m dlab bench scale``). Each method is
one launch of dlab's ``ddp`` and one of ``torch-ddp`` with PyTorch's hook for it, same model
(``dlab.bench.ddp.MODEL``: ~0.8 M parameters, where the bytes are large enough to matter),
global batch, seed and bucket cap, at 4 ranks (quick: 2 ranks, fewer steps). Rows, each with
``method`` and ``ranks``:

- ``metric="bytes_per_step"``: bytes rank 0 sent in the last step (PowerSGD compresses from its
  third), dlab beside the peer; ``ratio`` = dlab / peer, 1 where both follow the same rule.
- ``metric="step_s"``: the slowest rank's median step time (``run.summary()``), dlab beside the
  peer. PyTorch's PowerSGD waits for each bucket before the next on Gloo (``torch-ddp`` says
  why), so it does not overlap backward where dlab's does.
- ``metric="loss_and_bytes"``: dlab's final loss beside uncompressed ``ddp``'s after the same
  steps (what the compression cost), and the measured bytes per step beside
  ``dlab.theory.compression``'s formula.

``none`` (plain all-reduce) stands beside DDP's built-in C++ all-reduce. ``topk`` has no peer
in PyTorch: its rows carry no ``peer`` or ``ratio``. ``bf16``'s peer is PyTorch's
``bf16_compress_hook``, which DDP registers only on CUDA builds with NCCL but which runs on Gloo
when called from ``torch-ddp``'s counting hook (Gloo sums bf16).
"""
from __future__ import annotations

import tempfile

from dlab.analysis.steps import step_time
from dlab.bench import compared
from dlab.bench.ddp import BATCH, MODEL
from dlab.models import build
from dlab.procs.launch import launch
from dlab.theory import compression as est

CAP_MB = 1  # a few buckets, so that compression overlaps backward
# method -> (ddp's options, torch-ddp's options or None)
METHODS = {
    "none": ({}, {"comm_hook": "builtin"}),
    "fp16": ({"compress": "fp16"}, {"comm_hook": "fp16"}),
    "bf16": ({"compress": "bf16"}, {"comm_hook": "bf16"}),
    "powersgd": ({"compress": "powersgd"}, {"comm_hook": "powersgd"}),
    "topk": ({"compress": "topk"}, None),
}


def measure(strategy: str, n: int, options: dict, steps: int, runs_dir: str) -> dict:
    run = launch(strategy, n, runs_dir=runs_dir, wait=True, steps=steps, batch_size=BATCH,
                      model="gpt", model_options=MODEL, optimizer="sgd",
                      options={"bucket_cap_mb": CAP_MB, **options})
    last = run.metrics(0)[-1]
    return {"bytes": last["comm"]["sent_bytes"], "loss": last["loss"],
            "step_s": step_time(run)}


def rows(quick: bool = False) -> list[dict]:
    n, steps = (2, 6) if quick else (4, 12)
    shapes = [tuple(p.shape) for p in build("gpt", MODEL, 0).parameters()]
    out = []
    with tempfile.TemporaryDirectory(prefix="dlab-bench-compression-") as runs_dir:
        plain = None
        for method, (options, peer_options) in METHODS.items():
            m = measure("ddp", n, options, steps, runs_dir)
            peer = measure("torch-ddp", n, peer_options, steps, runs_dir) if peer_options else None
            for metric, key in (("bytes_per_step", "bytes"), ("step_s", "step_s")):
                what = {"method": method, "ranks": n, "metric": metric}
                out.append(compared(m[key], peer[key], **what) if peer else {**what, "dlab": m[key]})
            if method == "none":
                plain = m
                continue
            formula = est.bytes_per_step(method, shapes, int(CAP_MB * 2 ** 20), n, step=steps - 1)
            out.append({"method": method, "ranks": n, "metric": "loss_and_bytes", "final_loss": m["loss"],
                        "uncompressed_loss": plain["loss"], "bytes_per_step": m["bytes"],
                        "formula_bytes": formula})
    return out
