"""``plan``: one layout of one model on one cluster, predicted.

The step's time is the slowest pipeline rank's: its m micro-batches' forward, backward and
recomputation, the schedule's bubble on top of that work, its exposed communication, and the
optimizer (``dlab.theory.plan.time``). On a CPU whose cores the ranks outnumber it is instead every
rank's CPU seconds shared out over the cores, plus the cores' time no rank could use
("idle_cores"), unless one rank's own chain is longer ("bubble"). Memory is the fullest
rank's (``dlab.theory.plan.memory``). MFU counts the model's FLOPs (``Transformer.flops_per_token``),
HFU adds what recomputation repeats, both over N ranks' peak (as ``dlab.worker.train`` records them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dlab.theory import nd as nd_estimate
from dlab.theory.plan import time as tm
from dlab.theory.plan.memory import memory
from dlab.theory.plan.time import bubble_fraction


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


def assumed(lay) -> list[str]:
    """The overlaps a prediction assumes (``dlab.theory.plan.time``)."""
    grads = ("the gradient reduction behind the last micro-batch's backward" if lay.grad_overlap
             else "the gradient reduction not overlapped with backward, exposed")
    return [f"tp communication {'hidden' if lay.tp_overlap else 'exposed'}; cp's K/V passes hidden "
            f"behind attention; {grads}; ZeRO-3's gathers behind each micro-batch's compute; "
            "pipeline transfers and expert all-to-alls exposed"]


def _stage(spec, cluster, lay, global_batch: int, seq_len: int, pp_rank: int) -> dict:
    """One pipeline rank's step: its compute parts, its communication's exposed seconds and
    bytes per dimension, its optimizer, and their sum ("own"), all on a core of its own."""
    m = lay.for_batch(global_batch).microbatches
    comp = tm.stage_compute(spec, cluster, lay, seq_len, pp_rank)
    comm, sent = tm.comm_times(spec, cluster, lay, global_batch, seq_len, pp_rank, comp)
    parts = {"compute": m * (comp["forward"] + comp["backward"]), "recompute": m * comp["recompute"],
             **{f"{k}_comm": v for k, v in comm.items()},
             "optimizer": tm.optimizer_time(spec, cluster, lay, pp_rank)}
    return {"parts": parts, "sent": sent, "pp_rank": pp_rank, "own": sum(parts.values()),
            "work": parts["compute"] + parts["recompute"]}


def _step(stages: list[dict], cluster, lay, frac: float) -> dict[str, float]:
    """Seconds per step by part (module docstring; ``dlab.theory.plan.time`` on the CPU's cores)."""
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


def plan(spec, cluster, lay, global_batch: int, seq_len: int) -> Prediction:
    problems = [*spec.problems(), *lay.problems(spec, global_batch, seq_len)]
    if problems:
        raise PlanError(f"{lay.describe()}: " + "; ".join(problems))
    m = lay.for_batch(global_batch).microbatches
    frac = bubble_fraction(lay, m)
    # on a GPU cluster the stages differ only at the ends (embedding, head); on the CPU a middle
    # stage makes twice the end stages' pipeline transfers, each a measured hand-off
    ranks = range(lay.pp) if cluster.cores else sorted({0, lay.pp - 1})
    stages = [_stage(spec, cluster, lay, global_batch, seq_len, r) for r in ranks]
    parts = _step(stages, cluster, lay, frac)
    parts["total"] = sum(parts.values())
    sent = max(stages, key=lambda st: sum(st["sent"].values()))["sent"]
    if spec.gpt is not None:  # the lab's GPT: the busiest rank's exact bytes (dlab.theory.nd)
        cfg = dataclasses.replace(spec.gpt, seq_len=seq_len, recompute=lay.recompute)
        sent = max((nd_estimate.step_bytes(cfg, lay.for_batch(global_batch), global_batch, r)
                    for r in range(lay.pp)), key=lambda d: d["total"])
        sent.pop("total")
    mem = memory(spec, lay, global_batch, seq_len)
    tokens = global_batch * seq_len
    model_flops = spec.flops_per_token(seq_len) * tokens
    hw_flops = model_flops + spec.recompute_flops_per_token(seq_len, lay.recompute) * tokens
    peak = cluster.peak * lay.world  # per rank, as the runs record MFU (dlab.worker.train)
    capacity = cluster.memory - cluster.reserved
    notes = assumed(lay)
    if cluster.oversubscribed(lay.world):
        notes.append(f"{lay.world} ranks share {cluster.cores} cores: the step is their CPU seconds "
                     f"over the cores at {cluster.utilization:.0%} filled; nothing overlaps")
    elif cluster.cores:
        notes.append("a rank per core; nothing overlaps on the CPU")
    return Prediction(lay, mem, parts, tokens / parts["total"], model_flops / parts["total"] / peak,
                      hw_flops / parts["total"] / peak, mem["total"] <= capacity, capacity,
                      {**sent, "total": sum(sent.values())}, notes)
