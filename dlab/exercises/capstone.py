"""Notebook 14's briefs and its checked exercise: a layout that meets a brief's targets.

``BRIEF`` is the one the notebook works through; ``EXERCISE`` the learner's own, with other
sizes, so the worked answer is not the exercise's. Both name Megatron-Core's 2024 stack, and the
stack decides two things a layout would otherwise choose (``MEGATRON_CORE_2024``): the gradient
precision and the ZeRO stages on offer. ``capstone_layout()`` returns a ``dlab.plan.PlanLayout``
for ``EXERCISE``: every GPU of the cluster used, accepted by the planner's rules, one the
brief's stack can run (its precision, its ZeRO stages), within the memory target per GPU and at
or above the throughput target, both as ``dlab.plan.plan`` predicts them under that stack. A
layout that misses is told by how much and, from the planner's own breakdown, what dominates
(model state, activations, or time) and which dimensions act on it.
"""
from __future__ import annotations

from dlab.exercises.registry import exercise
from dlab.theory.plan import PlanError, PlanLayout, clusters, models, plan

#: what Megatron-Core r0.8 (July 2024) runs: bf16 training keeps and reduces the gradients in
#: fp32 (Megatron-LM's arguments.py turns on accumulate_allreduce_grads_in_fp32 with --bf16; its
#: distributed-optimizer notes count "bf16 param, fp32 grads" as 6 + 12/d bytes a parameter), and
#: the distributed optimizer shards the optimizer state only, the gradient buffer and the weights
#: staying whole on every data rank: ZeRO-1, or 0 without it; no ZeRO-2 or 3
MEGATRON_CORE_2024 = {"stack": "megatron-core-2024", "precision": "bf16-fp32-grads",
                      "zero_stages": (0, 1)}

#: the worked brief: long-context continued pre-training of an 8B model on 8 nodes
BRIEF = {"model": "llama3-8b", "cluster": "h100-sxm", **MEGATRON_CORE_2024, "gpus": 64,
         "seq_len": 32768, "global_batch": 128,  # sequences: 4M tokens per step
         "memory_GB": 60.0,  # per GPU, leaving the rest of 80 GB to the allocator and NCCL
         "tokens_per_s_per_gpu": 5000.0,
         # the tie-break: predictions this close to the fastest qualifying one are ties (the
         # planner's error on published runs is of this order: notebook 11); among them keep
         # this much memory under the target, then take the layout that keeps the most
         # tokens/s with no communication hidden behind compute
         "tie_within": 0.10, "min_headroom_GB": 6.0}
#: the exercise's brief: the same model pre-trained at 8k tokens on 4 nodes, beside another job
EXERCISE = {"model": "llama3-8b", "cluster": "h100-sxm", **MEGATRON_CORE_2024,
            "gpus": 32, "seq_len": 8192, "global_batch": 256,  # 2M tokens per step
            "memory_GB": 30.0, "tokens_per_s_per_gpu": 8000.0}

GB = 1e9


def describe_brief(brief: dict) -> str:
    """A brief in a few short lines: what a learner reads (a printed dict wraps mid-word in a
    notebook's output)."""
    b = brief
    stages = " or ".join(str(z) for z in b["zero_stages"])
    return "\n".join([
        f"model {b['model']} on {b['gpus']} x {b['cluster']}",
        f"stack {b['stack']}: precision {b['precision']}, ZeRO stage {stages}",
        f"sequence {b['seq_len']:,} tokens, global batch {b['global_batch']:,} sequences "
        f"({b['seq_len'] * b['global_batch']:,} tokens a step)",
        f"targets: at most {b['memory_GB']:g} GB per GPU, at least "
        f"{b['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU",
    ])


def predict(layout, brief: dict = BRIEF):
    """The planner's prediction of ``layout`` under ``brief``."""
    b = brief
    return plan(models.preset(b["model"]), clusters.preset(b["cluster"]), layout,
                b["global_batch"], b["seq_len"], b["stack"])


def run_capstone_layout(fn):
    return fn()


def _memory_hint(p, brief: dict) -> str:
    mem = p.memory
    state = mem["parameters"] + mem["gradients"] + mem["optimizer"]
    parts = (f"parameters {mem['parameters'] / GB:.1f}, gradients {mem['gradients'] / GB:.1f}, "
             f"optimizer {mem['optimizer'] / GB:.1f}, activations {mem['activations'] / GB:.1f} GB")
    if state >= mem["activations"]:
        more = [z for z in brief["zero_stages"] if z > p.layout.zero]
        if more:
            return (f"{parts}: model state dominates; shard it over data ranks (zero={max(more)}, "
                    f"the most {brief['stack']} offers) or split the model (tp, pp)")
        return (f"{parts}: model state dominates, and {brief['stack']} shards no more of it over "
                f"data ranks than zero={p.layout.zero} does: split the model (tp, pp)")
    return (f"{parts}: activations dominate; split the sequence (cp), split the layers' "
            f"activations with tp and sequence_parallel, or recompute")


def _stack_problems(layout, brief: dict) -> list[str]:
    """What the brief's stack cannot run: another gradient precision, a ZeRO stage it lacks."""
    out = []
    if layout.precision != brief["precision"]:
        out.append(f"{brief['stack']} trains bf16 with fp32 gradients (2 + 4 + 12 bytes a "
                   f"parameter): set precision={brief['precision']!r} (got {layout.precision!r})")
    if layout.zero not in brief["zero_stages"]:
        out.append(f"{brief['stack']}'s distributed optimizer shards the optimizer state only "
                   f"(ZeRO-1): use zero in {brief['zero_stages']} (got {layout.zero}); shard "
                   f"the rest with tp, pp or cp")
    return out


@exercise(name="capstone_layout", notebook="14_capstone",
          task="capstone_layout(): a dlab.plan.PlanLayout for the exercise's brief (EXERCISE in "
               "dlab.exercises.capstone) using every GPU, one its stack runs (its precision and "
               "ZeRO stages), within the memory target per GPU and at or above the tokens/s "
               "target, as dlab.plan.plan predicts them",
          run=run_capstone_layout)
def judge_capstone_layout(layout):
    b = EXERCISE
    if not isinstance(layout, PlanLayout):
        return f"return a dlab.plan.PlanLayout (got {type(layout).__name__})"
    wrong_stack = _stack_problems(layout, b)
    if wrong_stack:
        return f"{layout.describe()}: " + "; ".join(wrong_stack)
    if layout.world != b["gpus"]:
        return (f"{layout.describe()} uses {layout.world} GPUs; the brief has {b['gpus']}: "
                f"make dp x tp x pp x cp = {b['gpus']}")
    try:
        p = predict(layout, b)
    except PlanError as e:
        return f"the planner refuses it: {e}"
    where = f"{layout.describe()}"
    if p.memory["total"] > b["memory_GB"] * GB:
        return (f"{where} needs {p.memory['total'] / GB:.1f} GB per GPU, the target is "
                f"{b['memory_GB']:.0f} GB; {_memory_hint(p, b)}")
    per_gpu = p.tokens_per_s / layout.world
    if per_gpu < b["tokens_per_s_per_gpu"]:
        slowest = max((k for k in p.time if k != "total"), key=lambda k: p.time[k])
        return (f"{where} fits ({p.memory['total'] / GB:.1f} GB) but runs {per_gpu:,.0f} tokens/s "
                f"per GPU, the target is {b['tokens_per_s_per_gpu']:,.0f}; its largest time is "
                f"{slowest!r} ({p.time[slowest]:.2f} of {p.step_s:.2f} s a step)")
    return None
