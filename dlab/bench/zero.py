"""``python -m dlab bench zero``: memory per rank and bytes moved against the formulas, and step
time against PyTorch's FSDP2, for DDP and the three ZeRO stages.

For ``torch-ddp`` (fp32: PyTorch's DDP has no bf16 master-weight recipe of its own), ``zero1``,
``zero2``, ``zero3`` and ``torch-fsdp2`` (both in mixed precision: bf16 compute, fp32 master
weights and Adam state, so K = 12) at 2 and 4 ranks, one row each with:

- ``params_MiB``, ``grads_MiB``, ``optim_MiB``: each category measured on rank 0 (an offloaded
  optimizer counted under optim), beside ``*_formula_MiB``;
- ``model_state_MiB``: parameters + gradients + optimizer state measured on rank 0, beside
  ``formula_MiB`` (``dlab.theory.memory``: dlab's exact accounting, padding and step counters
  included; for DDP the full fp32 replica) and ``paper_MiB`` (the ZeRO paper's 2/2/12 bytes per
  parameter divided per stage; for FSDP2, whose shards stay fp32 and whose padding is per
  tensor, the same 16 Psi / N total), and ``err_pct`` = measured / formula - 1;
- ``reduce_scatter``: the ZeRO option (``backend``: Gloo's reduce-scatter, a whole all-reduce;
  ``ring``: dlab's ring reduce-scatter); zero2 and zero3 run both ways;
- ``model_MB_per_step``: the *ring model* of rank 0's bytes per step as ``Comm`` counts them,
  beside ``model_formula_MB_per_step`` (2 x (N-1)/N of the parameters' bytes for DDP and stages
  1-2, 3 x for stage 3); FSDP2's traffic bypasses dlab's counters and is left blank;
- ``wire_MB_per_step``: *measured*, the bytes rank 0's process wrote to Gloo's transport in a
  step (``dlab.comm.wire``; FSDP2's included), beside ``gloo_formula_MB_per_step``, the model of
  Gloo's real algorithms (``dlab.theory.memory.zero_wire_bytes``, framing included, plus the
  logged loss's all-reduce), for the dlab stages;
- ``step_s``: median step time after the first step.

Then, per world size, ``zero3`` step time against ``torch-fsdp2`` as a ``compared`` row (target:
ratio <= 1.25). ``--quick``: 2 ranks, DDP, zero2, zero3 and FSDP2, fewer steps.
"""
from __future__ import annotations

import tempfile

from dlab import models
from dlab.analysis.steps import step_time, wire_per_step
from dlab.bench import compared
from dlab.comm.gloo import gloo_all_reduce_bytes
from dlab.comm.wire import NOT_MEASURABLE
from dlab.procs.launch import launch
from dlab.theory.memory import (
    ddp_memory,
    model_units,
    paper_memory,
    zero_bytes_moved,
    zero_memory,
    zero_wire_bytes,
)

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 64}
MiB = 2 ** 20
STATE = ("parameters", "gradients", "optimizer")
STAGE = {"torch-ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "torch-fsdp2": 3}


def _formula(strategy: str, n: int) -> tuple[dict, float, float | None]:
    """(dlab formula bytes by category, paper bytes, bytes sent per step or None) for one rank."""
    units = model_units("gpt", MODEL)
    psi, stage = units.psi, STAGE[strategy]
    if strategy == "torch-ddp":
        numels = [p.numel() for p in models.build("gpt", MODEL, 0).parameters()]
        paper = sum(paper_memory(psi, n, 0, k=8, weight_bytes=4).values())
        return ddp_memory(numels), paper, zero_bytes_moved(units, n, 0)
    by_paper = paper_memory(psi, n, stage)
    if strategy == "torch-fsdp2":
        # FSDP2 keeps fp32 shards (bf16 only for compute): 4 + 4 + 8 bytes per parameter / N,
        # the same 16 Psi / N total as the paper's 2 + 2 + 12
        return paper_memory(psi, n, stage, k=8, weight_bytes=4), sum(by_paper.values()), None
    mem = zero_memory(units, n, stage, mixed_precision=True)
    return mem, sum(by_paper.values()), zero_bytes_moved(units, n, stage, True)


def _measure(strategy: str, n: int, steps: int, root, reduce_scatter: str = "") -> dict:
    options = {} if strategy == "torch-ddp" else {"mixed_precision": True}
    if reduce_scatter:
        options["reduce_scatter"] = reduce_scatter
    run = launch(strategy, n, runs_dir=root, wait=True, steps=steps, batch_size=8,
                 model_options=MODEL, options=options)
    ms = run.metrics(0)
    by_formula, paper, sent_formula = _formula(strategy, n)
    mem = dict(ms[-1]["memory"])
    mem["optimizer"] = mem.get("optimizer", 0) + mem.get("offloaded", 0)
    measured = sum(mem.get(k, 0) for k in STATE)
    exact = sum(by_formula[k] for k in STATE)
    per_category = {}
    for k, short in zip(STATE, ("params", "grads", "optim"), strict=True):
        per_category[f"{short}_MiB"] = mem.get(k, 0) / MiB
        per_category[f"{short}_formula_MiB"] = by_formula[k] / MiB
    return {"name": "zero", "strategy": strategy, "ranks": n,
            "precision": "fp32" if strategy == "torch-ddp" else "bf16+fp32 master",
            **per_category,
            "model_state_MiB": measured / MiB, "formula_MiB": exact / MiB, "paper_MiB": paper / MiB,
            "err_pct": 100 * (measured / exact - 1),
            "reduce_scatter": reduce_scatter,
            "model_MB_per_step": ms[-1]["comm"]["sent_bytes"] / 1e6 if sent_formula is not None else "",
            "model_formula_MB_per_step": sent_formula / 1e6 if sent_formula is not None else "",
            "wire_MB_per_step": _wire(ms),
            "gloo_formula_MB_per_step": (
                (zero_wire_bytes(model_units("gpt", MODEL), n, 0, STAGE[strategy], reduce_scatter,
                                 mixed_precision=True) + gloo_all_reduce_bytes(4, n, 0)) / 1e6
                if reduce_scatter else ""),
            "step_s": step_time(run)}


def _wire(ms: list[dict]):
    """Rank 0's measured bytes per step (``analysis.steps.wire_per_step``), if measurable."""
    wire = wire_per_step(ms)
    return NOT_MEASURABLE if wire is None else wire / 1e6


def run(quick: bool = False) -> list[dict]:
    sizes = (2,) if quick else (2, 4)
    strategies = (("torch-ddp", "zero2", "zero3", "torch-fsdp2") if quick
                  else ("torch-ddp", "zero1", "zero2", "zero3", "torch-fsdp2"))
    steps = 4 if quick else 8
    rows, timed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            for strategy in strategies:
                if strategy in ("zero1", "zero2", "zero3"):
                    for algorithm in ("backend", "ring") if strategy != "zero1" else ("backend",):
                        rows.append(_measure(strategy, n, steps, tmp, algorithm))
                else:
                    rows.append(_measure(strategy, n, steps, tmp))
            by = {r["strategy"]: r for r in rows if r["ranks"] == n and r["reduce_scatter"] != "ring"}
            timed.append(compared(by["zero3"]["step_s"], by["torch-fsdp2"]["step_s"], name="zero3 vs fsdp2",
                                  ranks=n, metric="step_s", target="<= 1.25"))
    return rows + timed
