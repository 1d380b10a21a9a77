"""Notebook 11's checked exercise: Korthikanti et al.'s activation estimate for a layout.

``activation_bytes(s, b, h, a, t, sp, recompute)``: the bytes one transformer layer keeps for
its backward on one rank (16-bit activations, 1-byte dropout masks, the 2022 attention that
stores its s x s scores), for a micro-batch of b sequences of s tokens, width h, a heads,
tensor parallelism over t ranks, with or without sequence parallelism, and no, selective or
full recomputation (Korthikanti et al. 2022, eqs. 1-4 and sec. 5). Checked on several layouts
against ``dlab.theory.plan.memory``, which counts the same layer tensor by tensor; a wrong
answer is named by its case and, where it is a known slip, by what it forgot.
"""
from __future__ import annotations

import math

from dlab.exercises.registry import exercise
from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.memory import layer_bytes
from dlab.theory.plan.spec import megatron_gpt

#: (s, b, h, a, t, sp, recompute): GPT-3 175B's shape at tp 8 (Korthikanti's table 3) and
#: smaller ones, each layout kind
CASES = [(2048, 1, 12288, 96, 1, False, "none"), (2048, 1, 12288, 96, 8, False, "none"),
         (2048, 1, 12288, 96, 8, True, "none"), (2048, 1, 12288, 96, 8, True, "selective"),
         (2048, 1, 12288, 96, 8, False, "full"), (2048, 1, 12288, 96, 8, True, "full"),
         (4096, 2, 4096, 32, 4, False, "selective"), (1024, 4, 2048, 16, 2, True, "none")]


def reference(s, b, h, a, t, sp, recompute) -> float:
    """What ``dlab.theory.plan.memory`` counts for the case, tensor by tensor."""
    lay = PlanLayout(tp=t, sequence_parallel=sp, recompute=recompute, attention="math")
    return layer_bytes(megatron_gpt("exercise", 1, h, a), lay, b, s)[0]


def _slips(s, b, h, a, t, sp, recompute) -> list[tuple[str, float]]:
    """What known slips would answer for the case (a neighbouring layout's answer), each with
    what it forgets."""
    out = []
    if t > 1 and not sp:
        out.append(("without sequence parallelism the 10 s b h of the norms' inputs, the dropout "
                    "masks and the QKV and MLP inputs are whole on every rank; only the 24 s b h "
                    "and the attention core split over t (eq. 2)",
                    reference(s, b, h, a, t, True, recompute)))
    if t > 1 and sp:
        out.append(("sequence parallelism splits over the same t ranks the 10 s b h that the "
                    "tensor-parallel regions leave whole: everything is divided by t (eq. 4)",
                    reference(s, b, h, a, t, False, recompute)))
    if recompute == "selective":
        out.append(("selective recomputation drops the attention core's 5 a s^2 b (its softmax, "
                    "dropout mask and their output) and keeps the rest (sec. 5)",
                    reference(s, b, h, a, t, sp, "none")))
    if recompute == "full":
        out += [("full recomputation keeps only the layer's input, 2 s b h (divided by t under "
                 "sequence parallelism, sec. 4.3)", reference(s, b, h, a, t, sp, kept))
                for kept in ("selective", "none")]
    return out


def run_activation_bytes(fn):
    return {case: fn(*case) for case in CASES}


@exercise(name="activation_bytes", notebook="11_planning_at_scale",
          task="activation_bytes(s, b, h, a, t, sp, recompute): bytes one layer keeps for backward "
               "on a rank (Korthikanti et al. 2022: 16-bit activations, 1-byte dropout masks, the "
               "s x s attention scores stored), under tensor parallelism t, sequence parallelism "
               "sp (True/False) and recompute 'none', 'selective' or 'full'",
          run=run_activation_bytes)
def judge_activation_bytes(answer):
    for (s, b, h, a, t, sp, rc), got in answer.items():
        want = reference(s, b, h, a, t, sp, rc)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        case = (f"s={s}, b={b}, h={h}, a={a}, t={t}, sequence parallel {'on' if sp else 'off'}, "
                f"recompute {rc!r}: expected {want / 1e6:.1f} MB, got {got / 1e6:.1f} MB")
        why = next((slip for slip, value in _slips(s, b, h, a, t, sp, rc)
                    if math.isclose(got, value, rel_tol=1e-9)), None)
        return f"{case}; {why}" if why else case
    return None
