"""``plan``: one layout of one model on one cluster, predicted.

The step's time is the slowest pipeline rank's: its m micro-batches' forward, backward and
recomputation, the schedule's bubble on top of that work, its exposed communication, and the
optimizer (``dlab.plan.time``). Memory is the fullest rank's (``dlab.plan.memory``). MFU counts
the model's FLOPs (``Transformer.flops_per_token``), HFU adds what recomputation repeats, both
over N GPUs' peak.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dlab.estimate import nd as nd_estimate
from dlab.plan import time as tm
from dlab.plan.memory import memory
from dlab.plan.time import bubble_fraction


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

    @property
    def step_s(self) -> float:
        return self.time["total"]

    def row(self) -> dict:
        """A flat dict: one row of a table or of ``--json``."""
        out = {"layout": self.layout.describe(), **self.layout.asdict(),
               "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
               "hfu": self.hfu, "fits": self.fits, "memory_GB": self.memory["total"] / 1e9}
        out.update({f"mem_{k}_GB": v / 1e9 for k, v in self.memory.items() if k not in ("total", "pp_rank")})
        out.update({f"time_{k}_s": v for k, v in self.time.items() if k != "total"})
        return out


ASSUMED = ["tp communication exposed unless tp_overlap; cp's K/V passes hidden behind attention; "
           "the gradient reduction behind the last micro-batch's backward; ZeRO-3's gathers behind "
           "each micro-batch's compute; pipeline transfers and expert all-to-alls exposed"]


def plan(spec, cluster, lay, global_batch: int, seq_len: int) -> Prediction:
    problems = [*spec.problems(), *lay.problems(spec, global_batch, seq_len)]
    if problems:
        raise PlanError(f"{lay.describe()}: " + "; ".join(problems))
    m = lay.microbatches(global_batch)
    worst = None
    for pp_rank in sorted({0, lay.pp - 1}):
        comp = tm.stage_compute(spec, cluster, lay, seq_len, pp_rank)
        work = m * (comp["forward"] + comp["backward"] + comp["recompute"])
        comm, sent = tm.comm_times(spec, cluster, lay, global_batch, seq_len, pp_rank, comp)
        total = work + sum(comm.values()) + tm.optimizer_time(spec, cluster, lay, pp_rank)
        if worst is None or total > worst[0]:
            worst = (total, comp, work, comm, sent, pp_rank)
    _, comp, work, comm, sent, pp_rank = worst
    if spec.gpt is not None:  # the lab's GPT: the busiest rank's exact bytes (dlab.estimate.nd)
        cfg = dataclasses.replace(spec.gpt, seq_len=seq_len, recompute=lay.recompute)
        sent = max((nd_estimate.step_bytes(cfg, lay.nd(global_batch), global_batch, r)
                    for r in range(lay.pp)), key=lambda d: d["total"])
        sent.pop("total")
    frac = bubble_fraction(lay, m)
    parts = {"compute": m * (comp["forward"] + comp["backward"]),
             "recompute": m * comp["recompute"],
             **{f"{k}_comm": v for k, v in comm.items()},
             "bubble": work * frac / (1 - frac),
             "optimizer": tm.optimizer_time(spec, cluster, lay, pp_rank)}
    parts["total"] = sum(parts.values())
    mem = memory(spec, lay, global_batch, seq_len)
    tokens = global_batch * seq_len
    model_flops = spec.flops_per_token(seq_len) * tokens
    hw_flops = model_flops + spec.recompute_flops_per_token(seq_len, lay.recompute) * tokens
    peak = cluster.peak * lay.world
    capacity = cluster.memory - cluster.reserved
    notes = list(ASSUMED)
    if cluster.cores:
        notes.append(f"{lay.world} ranks share {cluster.cores} cores; nothing overlaps on the CPU")
    return Prediction(lay, mem, parts, tokens / parts["total"], model_flops / parts["total"] / peak,
                      hw_flops / parts["total"] / peak, mem["total"] <= capacity, capacity,
                      {**sent, "total": sum(sent.values())}, notes)
