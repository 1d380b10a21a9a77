"""Every layout of a model on N GPUs, predicted, ranked, and the memory/time Pareto front.

The space (``layouts``): tp, pp and cp each a power of two (tp dividing the heads, pp at most
the layers), dp the rest of N; ZeRO stages 0-3 (those with more than one data rank); sequence
parallelism whenever tp > 1 (it only saves memory: Korthikanti et al. 2022); for pp > 1 the
1F1B schedule and the interleaved one with v = 2; micro-batches of 1, 2, 4 or 8 sequences;
no, selective or full recomputation; ep every divisor of the experts the data ranks take. A
layout the batch or model cannot take is skipped (``PlanLayout.problems``).

Ranked by predicted step time among those that fit; ``pareto`` keeps the layouts no other beats
on both memory and time. Speed: about 55 us a layout on the lab's 2-core CPU (``python -m dlab
plan --gpus N`` prints the count and the seconds): Llama 3 70B on 1024 GPUs, 19,248 layouts,
in about a second.
"""
from __future__ import annotations

import itertools

from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.predict import plan


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def layouts(spec, gpus: int, global_batch: int, seq_len: int, *, precision: str = "bf16",
            recompute=("none", "selective", "full"), zero=(0, 1, 2, 3),
            micro_batches=(1, 2, 4, 8), max_tp: int | None = None) -> list[PlanLayout]:
    out = []
    tps = [t for t in _powers(min(gpus, max_tp or gpus)) if spec.n_head % t == 0]
    for tp, pp, cp in itertools.product(tps, _powers(min(gpus, spec.n_layer)), _powers(gpus)):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        schedules = [("1f1b", 1), ("interleaved", 2)] if pp > 1 else [("1f1b", 1)]
        eps = [e for e in range(1, spec.n_expert + 1) if spec.n_expert % e == 0
               and (dp * cp) % e == 0] if spec.n_expert > 1 else [1]
        zeros = [z for z in zero if z == 0 or dp * cp > 1] if dp * cp > 1 else [0]
        for (sched, v), z, mb, rc, ep in itertools.product(schedules, zeros, micro_batches,
                                                           recompute, eps):
            lay = PlanLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=z, sequence_parallel=tp > 1,
                             schedule=sched, virtual_stages=v, micro_batch=mb, recompute=rc,
                             precision=precision)
            if not lay.problems(spec, global_batch, seq_len):
                out.append(lay)
    return out


def search(spec, cluster, gpus: int, global_batch: int, seq_len: int, stack=None, **space) -> list:
    """Predictions of every layout (``layouts``) under ``stack`` (``dlab.theory.plan.stacks``;
    its default when None): those that fit first, fastest first, then those that do not,
    smallest memory first."""
    preds = [plan(spec, cluster, lay, global_batch, seq_len, stack)
             for lay in layouts(spec, gpus, global_batch, seq_len, **space)]
    fit = sorted((p for p in preds if p.fits), key=lambda p: p.step_s)
    over = sorted((p for p in preds if not p.fits), key=lambda p: p.memory["total"])
    return fit + over


def pareto(preds: list) -> list:
    """The predictions no other beats on both memory and step time, by memory."""
    front, best = [], float("inf")
    for p in sorted(preds, key=lambda p: (p.memory["total"], p.step_s)):
        if p.step_s < best:
            front.append(p)
            best = p.step_s
    return front
