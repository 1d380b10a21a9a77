"""What the planner predicts for a run's own layout, to set beside what the run measured.

``predict_run(config)`` takes a run's configuration (the dict of its ``config.json``, or a
``RunConfig``) and returns the planner's figures for that run on this machine
(``dlab.theory.plan``): the step time with its range, tokens per second, MFU, memory per rank by
category (the fullest rank's, with the run's own optimizer) and the bytes a rank sends per step
by dimension. Theory beside measurement, for every run rather than only in a bench.

The layout is the run's strategy's own (``Strategy.layout``: ``nd``, ``tp``, ``cp``, ``ep``,
``pipeline-*``); the data-parallel strategies' is plain: every rank a replica (``ddp``,
``dp-naive``, ``torch-ddp``), ZeRO's stage over them (``zero1``-``zero3``, ``torch-fsdp2``),
one rank (``single``). The machine is the cluster preset of the run's GPU, or "this machine"
(``dlab.theory.plan.cluster.this_machine``: the CPU's measured matmul peak and the fitted
link; its collectives' measured costs need ``python -m dlab bench plan``'s calibration, so
here they cost the link's time), unless one is given. ``None`` where the planner cannot model
the run: a strategy with no layout (parameter servers, local SGD), the MLP, a run in mixed
precision (the lab's exact formulas count its GPT in fp32), a GPU it has no preset for, or a
layout it refuses.

On the CPU, "this machine" is as ``python -m dlab bench plan`` last calibrated it
(``docs/bench/plan.json``'s "(calibration)" and "(probe)" rows at the nearest number of ranks:
one thread's rate on the lab GPT, the fixed cost per layer, each collective's cost a call),
since measuring it afresh takes a minute; where that file has no calibration the collectives
cost the fitted link's time and the layers nothing fixed, and the figures say so.
"""
from __future__ import annotations

import dataclasses
import json

import torch

from dlab import parallel
from dlab.core.config import RunConfig
from dlab.core.machine import GPU_PEAK_FLOPS, gpu_count
from dlab.layout.layout import Layout
from dlab.theory import nd as nd_theory
from dlab.theory.plan import cluster as clusters
from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.predict import PlanError, plan
from dlab.theory.plan.ranges import step_range
from dlab.theory.plan.spec import from_gpt


def run_layout(config: RunConfig) -> Layout | None:
    """The run's layout as its strategy states it (``Strategy.planned_layout``), or None."""
    try:
        return parallel.get(config.strategy).planned_layout(config)
    except ValueError:
        return None


BENCH = clusters.FITTED_LINK.parent / "plan.json"


def recorded_machine(world: int, path=BENCH):
    """This CPU as ``bench plan`` last calibrated it, at the calibrated number of ranks nearest
    ``world`` (module docstring); the uncalibrated machine where there is none."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        rows = []
    calibrations = [r for r in rows if r.get("layout") == "(calibration)"]
    if not calibrations:
        return clusters.this_machine(ranks=world)
    cal = min(calibrations, key=lambda r: abs(r["ranks"] - world))
    calls = []
    for r in rows:
        if r.get("layout", "").startswith("(probe)") and r["ranks"] == cal["ranks"]:
            op, _, group = r["layout"].removeprefix("(probe) ").partition(" over ")
            calls.append((op, int(group), r["call_ms"] * 1e-3, 0.0))
    return clusters.this_machine(peak=cal["rate_GFLOPs"] * 1e9, ranks=world,
                                 layer_overhead=cal["layer_overhead_ms"] * 1e-3,
                                 ring_tile=(cal["tile_ms"] * 1e-3, cal["tile_ns_per_element"] * 1e-9),
                                 calls=tuple(calls),
                                 utilization=cal["utilization"] if world > 2 else 1.0)


def machine(config: RunConfig):
    """The cluster the run ran on: the preset of its GPU (at its fp32 peak: the lab trains in
    fp32, the presets price bf16 tensor-core kernels), or this CPU as last
    calibrated (``recorded_machine``); None for a GPU the planner has no preset for."""
    if config.resolved_device() == "cuda" and gpu_count():
        name = torch.cuda.get_device_name()
        for key, preset in (("A100", "a100-80gb"), ("H200", "h200"), ("H100", "h100-sxm")):
            if key in name:
                cluster = clusters.preset(preset)
                return dataclasses.replace(cluster, peak=GPU_PEAK_FLOPS[key]["fp32"])
        return None
    return recorded_machine(config.world_size)


def predict_run(config, cluster=None) -> dict | None:
    """The planner's figures for the run ``config`` (module docstring), or None."""
    cfg = config if isinstance(config, RunConfig) else RunConfig.from_dict(dict(config))
    if cfg.model not in ("gpt", "moe") or cfg.options.get("precision", "fp32") != "fp32":
        return None  # the lab's exact formulas count the GPT's state in fp32
    lay = run_layout(cfg)
    cluster = cluster or machine(cfg)
    if lay is None or cluster is None:
        return None
    model = cfg.model_config()
    m = lay.microbatches
    planned = PlanLayout(**{f.name: getattr(lay, f.name) for f in dataclasses.fields(Layout)},
                         micro_batch=max(cfg.batch_size // (lay.dp * m), 1),
                         recompute=getattr(model, "recompute", "none"), precision="fp32")
    try:
        p = plan(from_gpt(model), cluster, planned, cfg.batch_size, model.seq_len)
    except PlanError:
        return None
    state = max((nd_theory.model_state(model, planned, r, cfg.optimizer) for r in range(lay.pp)),
                key=lambda s: sum(s.values()))
    memory = {**{k: float(state[k]) for k in ("parameters", "gradients", "optimizer")},
              "activations": p.memory["activations"]}
    memory["total"] = sum(memory.values())
    low, high = step_range(p)
    notes = list(p.assumptions)
    if cluster.cores and not (cluster.calls or cluster.layer_overhead):
        notes.append("this machine's collectives and fixed cost per layer are not measured here "
                     "(python -m dlab bench plan calibrates them): a step no slower than this")
    return {"model": "the planner (dlab.theory.plan), not a measurement", "machine": cluster.name,
            "layout": planned.describe(), "step_s": p.step_s, "step_low_s": low,
            "step_high_s": high, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu,
            "memory_bytes": memory, "sent_bytes": dict(p.sent), "time_s": dict(p.time),
            "assumed": notes}
