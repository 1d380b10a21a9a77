"""Notebook 14's briefs and its checked exercise: a layout that meets a brief's targets.

``BRIEF`` is the one the notebook works through; ``EXERCISE`` the learner's own, with other
sizes, so the worked answer is not the exercise's. ``capstone_layout()`` returns a
``dlab.plan.PlanLayout`` for ``EXERCISE``: every
GPU of the cluster used, accepted by the planner's rules, within the memory target per GPU and
at or above the throughput target, both as ``dlab.plan.plan`` predicts them under the brief's
software stack. A layout that misses is told by how much and, from the planner's own breakdown,
what dominates (model state, activations, or time) and which dimensions act on it.
"""
from __future__ import annotations

from dlab.exercises.registry import exercise
from dlab.theory.plan import PlanError, PlanLayout, clusters, models, plan

#: the worked brief: long-context continued pre-training of an 8B model on 8 nodes
BRIEF = {"model": "llama3-8b", "cluster": "h100-sxm", "stack": "megatron-core-2024", "gpus": 64,
         "seq_len": 32768, "global_batch": 128,  # sequences: 4M tokens per step
         "memory_GB": 60.0,  # per GPU, leaving the rest of 80 GB to the allocator and NCCL
         "tokens_per_s_per_gpu": 5000.0}
#: the exercise's brief: the same model pre-trained at 8k tokens on 4 nodes, beside another job
EXERCISE = {"model": "llama3-8b", "cluster": "h100-sxm", "stack": "megatron-core-2024",
            "gpus": 32, "seq_len": 8192, "global_batch": 256,  # 2M tokens per step
            "memory_GB": 30.0, "tokens_per_s_per_gpu": 8500.0}

GB = 1e9


def predict(layout, brief: dict = BRIEF):
    """The planner's prediction of ``layout`` under ``brief``."""
    b = brief
    return plan(models.preset(b["model"]), clusters.preset(b["cluster"]), layout,
                b["global_batch"], b["seq_len"], b["stack"])


def run_capstone_layout(fn):
    return fn()


def _memory_hint(p) -> str:
    mem = p.memory
    state = mem["parameters"] + mem["gradients"] + mem["optimizer"]
    parts = (f"parameters {mem['parameters'] / GB:.1f}, gradients {mem['gradients'] / GB:.1f}, "
             f"optimizer {mem['optimizer'] / GB:.1f}, activations {mem['activations'] / GB:.1f} GB")
    if state >= mem["activations"]:
        return (f"{parts}: model state dominates; shard it over data ranks (zero 1-3) or split "
                f"the model (tp, pp)")
    return (f"{parts}: activations dominate; split the sequence (cp), split the layers' "
            f"activations with tp and sequence_parallel, or recompute")


@exercise(name="capstone_layout", notebook="14_capstone",
          task="capstone_layout(): a dlab.plan.PlanLayout for the exercise's brief (EXERCISE in "
               "dlab.exercises.capstone) using every GPU, within the memory target per GPU and at "
               "or above the tokens/s target, as dlab.plan.plan predicts them",
          run=run_capstone_layout)
def judge_capstone_layout(layout):
    b = EXERCISE
    if not isinstance(layout, PlanLayout):
        return f"return a dlab.plan.PlanLayout (got {type(layout).__name__})"
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
                f"{b['memory_GB']:.0f} GB; {_memory_hint(p)}")
    per_gpu = p.tokens_per_s / layout.world
    if per_gpu < b["tokens_per_s_per_gpu"]:
        slowest = max((k for k in p.time if k != "total"), key=lambda k: p.time[k])
        return (f"{where} fits ({p.memory['total'] / GB:.1f} GB) but runs {per_gpu:,.0f} tokens/s "
                f"per GPU, the target is {b['tokens_per_s_per_gpu']:,.0f}; its largest time is "
                f"{slowest!r} ({p.time[slowest]:.2f} of {p.step_s:.2f} s a step)")
    return None
