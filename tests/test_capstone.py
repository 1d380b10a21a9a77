"""Notebook 14's checked exercise judges a layout as the brief's stack runs it: Megatron-Core 2024
keeps and reduces bf16 training's gradients in fp32 and its distributed optimizer is ZeRO-1, so a
layout that fits only with the ZeRO paper's 2-byte gradients, or only with ZeRO-2 or 3, fails and
is told what to change."""
from __future__ import annotations

import pytest

from dlab.exercises import check
from dlab.exercises.capstone import BRIEF, EXERCISE, describe_brief

PSI = 8.03e9  # Llama 3 8B's parameters (Meta's model card: 8.03B)


def _layout(**fields) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    return f"def capstone_layout():\n    from dlab.plan import PlanLayout\n    return PlanLayout({args})\n"


def test_both_briefs_name_the_stacks_precision_and_zero_stages():
    for brief in (BRIEF, EXERCISE):
        assert brief["stack"] == "megatron-core-2024"
        assert brief["precision"] == "bf16-fp32-grads" and brief["zero_stages"] == (0, 1)


def test_a_layout_that_fits_only_with_two_byte_gradients_fails():
    """dp8 x cp2 x tp2 ZeRO-1 fits the exercise's 30 GB with 2-byte gradients, not with 4."""
    shape = dict(dp=8, cp=2, tp=2, zero=1, sequence_parallel=True)
    report = check("capstone_layout", _layout(**shape))
    assert not report.ok and "set precision='bf16-fp32-grads'" in report.message, report
    report = check("capstone_layout", _layout(**shape, precision="bf16-fp32-grads"))
    fp32_grads = 4 * PSI / 2 / 1e9  # 4 bytes a parameter, cut by tp = 2; ZeRO-1 leaves them whole
    assert not report.ok and f"gradients {fp32_grads:.1f}" in report.message, report
    assert "needs" in report.message and "the target is 30 GB" in report.message, report


@pytest.mark.parametrize("zero", [2, 3])
def test_a_zero_stage_the_stack_lacks_fails(zero):
    """dp16 x tp2 with ZeRO-3 meets both targets by the planner; the stack cannot run it."""
    report = check("capstone_layout", _layout(dp=16, tp=2, zero=zero, sequence_parallel=True,
                                               precision="bf16-fp32-grads"))
    assert not report.ok and "shards the optimizer state only (ZeRO-1)" in report.message, report
    assert f"(got {zero})" in report.message, report


@pytest.mark.parametrize("brief", [BRIEF, EXERCISE], ids=["BRIEF", "EXERCISE"])
def test_a_brief_prints_as_short_lines_with_each_target(brief):
    """The notebook prints the exercise's brief for the learner: short lines (a printed dict is
    one long line that the output area wraps mid-word), every figure the checker holds them to."""
    text = describe_brief(brief)
    assert all(len(line) <= 90 for line in text.splitlines()), text
    for shown in (brief["model"], brief["stack"], brief["precision"], f"{brief['gpus']} x",
                  f"{brief['seq_len']:,} tokens", f"{brief['global_batch']:,} sequences",
                  f"at most {brief['memory_GB']:g} GB", f"{brief['tokens_per_s_per_gpu']:,.0f} tokens/s"):
        assert shown in text, (shown, text)
