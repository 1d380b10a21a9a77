"""Notebook 11's checked exercise (``dlab.exercises.planning``): the checker passes the reference
solution and names a typical mistake, saying which layout is wrong and what was forgotten."""
from __future__ import annotations

from pathlib import Path

import pytest

from dlab.exercises import EXERCISES, check

SOLUTIONS = Path(__file__).resolve().parent.parent / "docs" / "instructor" / "solutions"
SOLUTION = SOLUTIONS / "activation_bytes.py"

MISTAKES = [  # a learner's typical wrong answers, and what the report must say
    ("def activation_bytes(s, b, h, a, t, sp, recompute):\n"  # every term split by t, sp or not
     "    sbh = s * b * h\n"
     "    if recompute == 'full':\n        return 2 * sbh / t\n"
     "    core = 0 if recompute == 'selective' else 5 * a * s * s * b\n"
     "    return (34 * sbh + core) / t\n",
     "t=8, sequence parallel off, recompute 'none': expected 578.8 MB, got 358.6 MB; without "
     "sequence parallelism the 10 s b h"),
    ("def activation_bytes(s, b, h, a, t, sp, recompute):\n"  # selective keeps the core
     "    sbh = s * b * h\n"
     "    if recompute == 'full':\n        return 2 * sbh / (t if sp else 1)\n"
     "    return 10 * sbh / (t if sp else 1) + 24 * sbh / t + 5 * a * s * s * b / t\n",
     "recompute 'selective': expected 107.0 MB, got 358.6 MB; selective recomputation drops the "
     "attention core"),
]


def test_the_exercise_is_registered_for_notebook_11():
    assert EXERCISES["activation_bytes"].notebook == "11_planning_at_scale"


def test_the_checker_passes_the_solution(runs_dir):
    report = check("activation_bytes", SOLUTION.read_text(), runs_dir=str(runs_dir))
    assert report.ok, report


@pytest.mark.parametrize("wrong,says", MISTAKES)
def test_the_checker_names_the_mistake_and_what_it_forgot(wrong, says, runs_dir):
    report = check("activation_bytes", wrong, runs_dir=str(runs_dir))
    assert not report.ok and says in report.message, report
