"""A prediction's range: how far its step time moves when each constant it uses moves within
its spread.

Each constant has a nominal value and a (low, high) multiplier (``Cluster.spread``: the
kernels' shares of peak, the memory and link bandwidths; ``KNOBS``: the planner-wide ones). The
step is predicted again with each constant alone at its low and at its high end; the slower and
the faster deviations are combined apart, each as the root of the sum of their squares (the
constants' errors taken as independent), into the step's high and low. A constant with no
spread moves nothing, so a prediction whose constants are all measured on its own machine has
a narrow range and one whose constants are guesses a wide one.

``KNOBS``: the sustained share's spread is how far each source's own fit lies from the
common one (``dlab.theory.plan.published.spread``: what an unseen stack's share has been
seen to do), the interference of hidden collectives from none to twice its 0.1, each stack's
overlap shares from 70 % of what the stack promises to all of it.
"""
from __future__ import annotations

import dataclasses
import math

from dlab.theory.plan.predict import SUSTAINED_SPREAD, plan

KNOBS = {"sustained": SUSTAINED_SPREAD, "interference": (0.0, 2.0), "overlap": (0.7, 1.0)}


def perturbed(cluster, name: str, factor: float):
    """``cluster`` with one constant multiplied by ``factor``."""
    k = cluster.kernels
    if name == "matmul":
        return dataclasses.replace(cluster, kernels=dataclasses.replace(
            k, matmul=k.matmul * factor,
            matmul_table=tuple((*r[:3], r[3] * factor) for r in k.matmul_table)))
    if name == "attention":
        return dataclasses.replace(cluster, kernels=dataclasses.replace(
            k, attention=tuple((n, f * factor, b * factor) for n, f, b in k.attention),
            attention_table=tuple((r[0], r[1] * factor, r[2] * factor) for r in k.attention_table)))
    if name == "launch":
        return dataclasses.replace(cluster, kernels=dataclasses.replace(k, launch=k.launch * factor))
    if name in ("intra", "inter"):
        link = getattr(cluster, name)
        ops = tuple((op, lvl, lat, bw * factor if lvl == name else bw) for op, lvl, lat, bw in cluster.ops)
        moved = dataclasses.replace(link, beta=link.beta / factor)
        return dataclasses.replace(cluster, ops=ops, **{name: moved})
    if name == "latency":
        ops = tuple((op, lvl, lat * factor, bw) for op, lvl, lat, bw in cluster.ops)
        return dataclasses.replace(cluster, ops=ops, **{
            lvl: dataclasses.replace(getattr(cluster, lvl), alpha=getattr(cluster, lvl).alpha * factor)
            for lvl in ("intra", "inter")})
    if name in ("hbm", "peak"):
        return dataclasses.replace(cluster, **{name: getattr(cluster, name) * factor})
    raise ValueError(f"no constant {name!r} to vary; a spread names matmul, attention, launch, "
                     f"intra, inter, latency, hbm, peak or step")


def step_range(pred, knobs: dict | None = None) -> tuple[float, float]:
    """(low, high) step seconds of a ``Prediction`` (module docstring)."""
    spec, cluster, global_batch, seq_len, base = pred.inputs
    knobs = KNOBS if knobs is None else knobs
    t0 = pred.step_s
    ups, downs = [], []

    def note(step):
        d = step / t0 - 1
        (ups if d > 0 else downs).append(d)

    for name, lo, hi in cluster.spread:
        for factor in (lo, hi):
            if name == "step":  # a whole-step spread (the CPU machine's run-to-run variation)
                note(t0 / factor)
                continue
            note(plan(spec, perturbed(cluster, name, factor), pred.layout, global_batch, seq_len,
                      pred.stack, base).step_s)
    if not cluster.cores:
        for name, (lo, hi) in knobs.items():
            for factor in (lo, hi):
                knob = dataclasses.replace(base, **{name: getattr(base, name) * factor})
                note(plan(spec, cluster, pred.layout, global_batch, seq_len, pred.stack, knob).step_s)
    return (t0 * (1 - math.sqrt(sum(d * d for d in downs))),
            t0 * (1 + math.sqrt(sum(d * d for d in ups))))
