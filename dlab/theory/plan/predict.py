"""``plan``: one layout of one model on one cluster under one software stack, predicted.

On a GPU cluster the step is the slowest pipeline rank's: its micro-batches' operations
(``dlab.theory.plan.ops``), its exposed communication after each overlap's share, what the
hidden communication costs the compute beside it, the optimizer, and the schedule's bubble on
its time per micro-batch (``dlab.theory.plan.time``). On the lab's CPU (``Cluster.cores``) the
step is modelled from that machine's own measurements (``dlab.theory.plan.cpu``): with a core
per rank the slowest rank's compute and calls, with more ranks than cores every rank's CPU
seconds shared out over the cores, plus the cores' time no rank could use ("idle_cores"),
unless one rank's own chain is longer ("bubble"). Memory is the fullest rank's
(``dlab.theory.plan.memory``). MFU counts the model's FLOPs (``Transformer.flops_per_token``),
HFU adds what recomputation repeats (every ``recompute_every``-th layer's forward under full
recomputation), both over N ranks' peak by ``dlab.models.flops.utilization``, the function
``dlab.worker.train`` records them with. ``dlab.theory.plan.ranges.step_range`` gives a
prediction's low and high step time from the spread of the constants it used.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dlab.models.flops import utilization
from dlab.theory import nd as nd_estimate
from dlab.theory.plan import cpu
from dlab.theory.plan import stacks as stack_presets
from dlab.theory.plan import time as tm
from dlab.theory.plan.memory import memory
from dlab.theory.plan.time import Knobs, bubble_fraction

#: the share of a kernel's benchmarked rate it keeps inside a training step, per GPU die (a
#: step's sustained power lowers the clocks a benchmark's best iteration ran at; neighbouring
#: kernels evict the caches): the constants the published rows choose
#: (``dlab.theory.plan.published.fit``, which finds these values over every source; each
#: source's own error is scored with them refitted without that source)
SUSTAINED = {"A100": 0.798, "H100": 0.729}
#: how far a source's own fit has lain from these, either way (``published.spread``): the
#: shares' spread (``ranges.KNOBS``)
SUSTAINED_SPREAD = (0.81, 1.19)


def sustained(cluster) -> float:
    """The sustained share for ``cluster``'s GPU die (1 where none is fitted)."""
    return SUSTAINED.get(cluster.generation, 1.0)


class PlanError(ValueError):
    """A layout the model, batch or cluster cannot take; the message says what to change."""


@dataclass
class Prediction:
    layout: object
    memory: dict[str, float]  # bytes per GPU by category, "total"
    time: dict[str, float]  # seconds per step by part, "total"
    tokens_per_s: float
    mfu: float
    hfu: float
    fits: bool
    capacity: float  # bytes a GPU can give to tensors
    sent: dict[str, float] = field(default_factory=dict)  # bytes sent per step by dimension
    assumptions: list[str] = field(default_factory=list)
    stack: object = None
    #: what it was asked: (spec, cluster, global batch, sequence, knobs), for ``ranges``
    inputs: tuple = field(default=(), repr=False)

    @property
    def step_s(self) -> float:
        return self.time["total"]

    def row(self) -> dict:
        """A flat dict: one row of a table or of ``--json``."""
        out = {"layout": self.layout.describe(), **self.layout.asdict(),
               "stack": getattr(self.stack, "name", None),
               "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
               "hfu": self.hfu, "fits": self.fits, "memory_GB": self.memory["total"] / 1e9}
        out.update({f"mem_{k}_GB": v / 1e9 for k, v in self.memory.items() if k not in ("total", "pp_rank")})
        out.update({f"time_{k}_s": v for k, v in self.time.items() if k != "total"})
        out.update({f"sent_{k}_GB": v / 1e9 for k, v in self.sent.items()})
        return out


def assumed(lay, stack, cluster) -> list[str]:
    """What a prediction assumes: the stack, and on the CPU that nothing overlaps; then what
    the cluster prices without a measurement of its own (``Cluster.notes``)."""
    if cluster.cores:
        return ["this machine's measured rates and calls; nothing overlaps on the CPU", *cluster.notes]
    return [f"stack {stack.describe()}", *cluster.notes]


def _cpu_step(stages: list[dict], cluster, lay, frac: float) -> dict[str, float]:
    """Seconds per step by part on the CPU machine (``dlab.theory.plan.cpu``)."""
    if not cluster.oversubscribed(lay.world):
        worst = max(stages, key=lambda st: st["own"] + st["work"] * frac / (1 - frac))
        return {**worst["parts"], "bubble": worst["work"] * frac / (1 - frac)}
    # every rank's CPU seconds over the cores: each part's core-seconds summed over the ranks
    per_stage = lay.world // lay.pp
    share = {k: per_stage * sum(st["parts"][k] for st in stages) / cluster.cores
             for k in stages[0]["parts"]}
    shared = sum(share.values()) / cluster.utilization
    chain = max(st["own"] + st["work"] * frac / (1 - frac) for st in stages)  # one core at most
    return {**share, "idle_cores": shared - sum(share.values()),
            "bubble": max(0.0, chain - shared)}


def _cpu_stage(spec, cluster, lay, global_batch: int, seq_len: int, pp_rank: int) -> dict:
    m = lay.for_batch(global_batch).microbatches
    comp = cpu.stage_compute(spec, cluster, lay, seq_len, pp_rank)
    comm, sent = cpu.comm_times(spec, cluster, lay, global_batch, seq_len, pp_rank, comp)
    parts = {"compute": m * (comp["forward"] + comp["backward"]), "recompute": m * comp["recompute"],
             **{f"{k}_comm": v for k, v in comm.items()},
             "optimizer": tm.optimizer_time(spec, cluster, lay, pp_rank)}
    return {"parts": parts, "sent": sent, "pp_rank": pp_rank, "own": sum(parts.values()),
            "work": parts["compute"] + parts["recompute"]}


def _gpu_step(stages: list[dict], frac: float) -> dict[str, float]:
    worst = max(stages, key=lambda st: st["own"] + st["busy"] * frac / (1 - frac))
    return {**worst["parts"], "bubble": worst["busy"] * frac / (1 - frac)}


def plan(spec, cluster, lay, global_batch: int, seq_len: int, stack=None,
         knobs: Knobs | None = None) -> Prediction:
    """Predict ``lay`` for ``spec`` on ``cluster`` under ``stack`` (a ``Stack`` or its name;
    default ``stacks.DEFAULT``). ``knobs``: the planner-wide constants (default: the cluster's
    ``SUSTAINED`` share and the rest at their nominal values)."""
    if stack is None or isinstance(stack, str):
        stack = stack_presets.preset(stack or stack_presets.DEFAULT)
    knobs = knobs or Knobs(sustained=sustained(cluster))
    problems = [*spec.problems(), *lay.problems(spec, global_batch, seq_len)]
    if not cluster.cores and cluster.kernels is None:
        problems.append(f"the cluster {cluster.name!r} has no kernel figures: give it Kernels or "
                        f"use a preset or a calibrated profile")
    if problems:
        raise PlanError(f"{lay.describe()}: " + "; ".join(problems))
    m = lay.for_batch(global_batch).microbatches
    frac = bubble_fraction(lay, m)
    if cluster.cores:
        # a middle stage makes twice the end stages' pipeline transfers, each a measured hand-off
        stages = [_cpu_stage(spec, cluster, lay, global_batch, seq_len, r) for r in range(lay.pp)]
        parts = _cpu_step(stages, cluster, lay, frac)
    else:  # the stages differ only at the ends (embedding, head)
        stages = [tm.stage(spec, cluster, lay, stack, global_batch, seq_len, r, knobs)
                  for r in sorted({0, lay.pp - 1})]
        parts = _gpu_step(stages, frac)
    parts["total"] = sum(parts.values())
    sent = max(stages, key=lambda st: sum(st["sent"].values()))["sent"]
    if spec.gpt is not None:  # the lab's GPT: the busiest rank's exact bytes (dlab.theory.nd)
        cfg = dataclasses.replace(spec.gpt, seq_len=seq_len, recompute=lay.recompute)
        sent = max((nd_estimate.step_bytes(cfg, lay.for_batch(global_batch), global_batch, r)
                    for r in range(lay.pp)), key=lambda d: d["total"])
        sent.pop("total")
    mem = memory(spec, lay, global_batch, seq_len, stack)
    tokens = global_batch * seq_len
    model_flops = spec.flops_per_token(seq_len)
    hw_flops = model_flops + spec.recompute_flops_per_token(seq_len, lay.recompute, lay.recompute_every)
    capacity = cluster.memory - cluster.reserved
    notes = assumed(lay, stack, cluster)
    if cluster.oversubscribed(lay.world):
        notes.append(f"{lay.world} ranks share {cluster.cores} cores: the step is their CPU seconds "
                     f"over the cores at {cluster.utilization:.0%} filled")
    # per rank, as the runs record them (dlab.worker.train): one utilization function for both
    mfu, hfu = (utilization(f, tokens, parts["total"], cluster.peak, lay.world)
                for f in (model_flops, hw_flops))
    return Prediction(lay, mem, parts, tokens / parts["total"], mfu, hfu, mem["total"] <= capacity,
                      capacity,
                      {**sent, "total": sum(sent.values())}, notes, stack,
                      (spec, cluster, global_batch, seq_len, knobs))
