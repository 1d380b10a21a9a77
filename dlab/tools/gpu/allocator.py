"""The CUDA caching allocator beside dlab's count, over one training step of the lab GPT.

dlab counts memory from the tensors a rank holds (``dlab.core.metrics``: parameters,
gradients, optimizer state from their storages; activations as the bytes autograd saved for
backward), the same on the CPU and on a GPU. The allocator knows more and less: it also holds
what no category names (the forward's temporaries, cuBLAS's workspace, the logits' fp32 copy
for the loss), and it rounds each block up and keeps freed blocks cached (``reserved``); it
does not know what a tensor is for. At the end of each phase of the step (dlab's timeline
spans: forward, backward, optimizer) both are read; the step's peaks are compared, and on a
GPU the allocator's history of the step is kept as a snapshot (``memory_snapshot.pickle.gz``,
for https://pytorch.org/memory_viz).

Without CUDA dlab's count is measured as on a GPU and the allocator's columns are empty, the
row saying why.
"""
from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import torch

from dlab.tools.gpu import gpt_step

SNAPSHOT_ENTRIES = 200_000


def run(ctx):
    cfg = gpt_step.config(ctx.cuda)
    phases = []
    holder = {}

    def read(kind: str) -> None:
        mem = holder["strategy"].memory()
        mem["activations"] = holder["strategy"].meter.current  # held now, not the peak
        dlab = {k: int(v) for k, v in mem.items()}
        phases.append({"phase": kind, "dlab": dlab, "dlab_total": sum(dlab.values()),
                       "allocated": torch.cuda.memory_allocated() if ctx.cuda else None,
                       "reserved": torch.cuda.memory_reserved() if ctx.cuda else None})

    timeline = gpt_step.MarkedTimeline(on_end=read)
    snapshot = None
    with gpt_step.one_rank(ctx.cuda):
        holder["strategy"], data = gpt_step.build(cfg, timeline)
        holder["strategy"].step(data.global_batch(0))  # the first creates Adam's state
        gpt_step.sync(ctx.cuda)
        phases.clear()
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
            # Python stacks only: symbolising C++ frames can take minutes of the lent time
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=SNAPSHOT_ENTRIES)
        holder["strategy"].step(data.global_batch(1))
        gpt_step.sync(ctx.cuda)
        if ctx.cuda:
            stats = torch.cuda.memory_stats()
            with gzip.open(Path(ctx.out) / "memory_snapshot.pickle.gz", "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            torch.cuda.memory._record_memory_history(enabled=None)
            snapshot = "memory_snapshot.pickle.gz"
    # at the forward's end the saved activations are at their peak (the meter tracks the
    # forward) and the gradients not yet made; at the backward's end the reverse
    dlab_peak = max(p["dlab_total"] for p in phases)
    doc = {"model": cfg.model_options, "batch": cfg.batch_size, "precision": cfg.options["precision"],
           "phases": phases, "dlab_peak": int(dlab_peak),
           "allocator_peak": stats["allocated_bytes.all.peak"] if ctx.cuda else None,
           "reserved_peak": stats["reserved_bytes.all.peak"] if ctx.cuda else None,
           "snapshot": snapshot,
           "why": None if ctx.cuda else ("no CUDA: the caching allocator is CUDA's; dlab's count is "
                                         "the same on both")}
    mb = 1 / 2 ** 20
    line = (f"dlab counts {dlab_peak * mb:.1f} MiB at the peak" +
            (f", the allocator {doc['allocator_peak'] * mb:.1f} MiB allocated "
             f"({doc['reserved_peak'] * mb:.1f} MiB reserved)" if ctx.cuda else "; no allocator (CPU)"))
    return doc, line, [snapshot] if snapshot else []
