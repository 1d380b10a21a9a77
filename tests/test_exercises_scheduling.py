"""Notebook 13's checked exercise on gang scheduling (``dlab.exercises.scheduling``): the checker
passes the reference solution and names the rule each typical mistake breaks, with the case and
the jobs it breaks it with; its rules never fault the reference answer, on random cases too."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from dlab.exercises import EXERCISES, check
from dlab.exercises.registry import define
from dlab.exercises.scheduling import _broken_rule, admit, reservation

SOLUTION = Path(__file__).resolve().parent.parent / "docs" / "instructor" / "solutions" / "gang_admit.py"

FIRST_FIT = ("def gang_admit(queue, free, running, backfill):\n"  # every job that fits, in order
             "    started = []\n"
             "    for name, gpus, hours in queue:\n"
             "        if gpus <= free:\n            started.append(name)\n            free -= gpus\n"
             "    return started\n")

MISTAKES = {  # a learner's typical wrong answers, and what the report must say
    "first-fit": (
        FIRST_FIT, "backfill off: job C started ahead of job B, which waits for 4 GPUs: without "
                   "backfill the first job that does not fit holds the line"),
    "some-of-its-gpus": (
        "def gang_admit(queue, free, running, backfill):\n"
        "    started = []\n"
        "    for name, gpus, hours in queue:\n"
        "        if free <= 0:\n            break\n"
        "        started.append(name)\n        free -= gpus\n"
        "    return started\n",
        "job B needs 4 GPUs and 2 are free once the jobs before it have theirs: a job starts with "
        "all of its GPUs at once or waits"),
    "backfill-without-reservation": (
        "def gang_admit(queue, free, running, backfill):\n"  # any job that fits, once on
        "    started, blocked = [], False\n"
        "    for name, gpus, hours in queue:\n"
        "        if gpus <= free and (backfill or not blocked):\n"
        "            started.append(name)\n            free -= gpus\n"
        "        else:\n            blocked = True\n"
        "    return started\n",
        "backfill on: job B (2 GPUs for 5 h) would still hold its GPUs at 2 h, when job A can "
        "start, and needs more than the 1 GPU job A leaves spare then: backfill may not delay"),
    "reservation-from-running-jobs-alone": (
        SOLUTION.read_text().replace("        ends.append((gpus, hours))", "        pass"),
        "job C (2 GPUs for 3 h) would still hold its GPUs at 1 h, when job B can start, and needs "
        "more than the 0 GPUs job B leaves spare then"),
    "spare-taken-by-every-backfill": (
        SOLUTION.read_text().replace("            started.append(name)\n            free -= gpus\n"
                                     "        elif gpus <= spare:",
                                     "            started.append(name)\n            free -= gpus\n"
                                     "            spare -= gpus\n        elif gpus <= spare:"),
        "expected ['B', 'C'], got ['B']: job C fits in the free GPUs and does not delay the first "
        "job in line"),
}


@pytest.mark.parametrize("answer", ["return None", "return [['A']]", "return ['Z']"])
def test_an_answer_that_is_not_a_list_of_waiting_jobs_is_named(answer):
    report = check("gang_admit", f"def gang_admit(queue, free, running, backfill):\n    {answer}\n")
    assert not report.ok and "expected a list of the waiting jobs' names (['A', 'B']), got" in report.message


def test_the_exercise_is_registered_for_notebook_13():
    assert EXERCISES["gang_admit"].notebook == "13_what_breaks_at_scale"


def test_the_checker_passes_the_solution():
    report = check("gang_admit", SOLUTION.read_text())
    assert report.ok, report


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_the_checker_names_the_rule_a_mistake_breaks(name):
    wrong, says = MISTAKES[name]
    assert wrong != SOLUTION.read_text()  # the mistake's edit applied
    report = check("gang_admit", wrong)
    assert not report.ok and says in report.message, report


def _random_case(rng: random.Random):
    queue = [(chr(65 + i), rng.randint(1, 6), rng.randint(1, 9)) for i in range(rng.randint(1, 5))]
    running = [(rng.randint(1, 6), rng.randint(1, 9)) for _ in range(rng.randint(0, 3))]
    free = rng.randint(0, 6)
    # every job can start some day: the cluster holds the largest
    free = max(free, max(g for _, g, _ in queue) - sum(g for g, _ in running))
    return queue, free, running, rng.random() < 0.5


def test_the_rules_never_fault_the_reference_and_the_solution_agrees_with_it():
    """On 500 random cases: the judge's rules find nothing wrong with ``admit``'s answer (else a
    right answer would fail), and the instructor's solution gives the same answer."""
    solution = define(SOLUTION.read_text(), "gang_admit")
    rng = random.Random(13)
    for _ in range(500):
        queue, free, running, backfill = _random_case(rng)
        want = admit(queue, free, running, backfill)
        assert _broken_rule(queue, free, running, backfill, want) is None, (queue, free, running, backfill)
        assert solution(list(queue), free, list(running), backfill) == want, (queue, free, running, backfill)


def test_the_reservation_is_the_earliest_time_enough_gpus_are_free():
    assert reservation(4, 1, [(2, 5.0), (2, 1.0), (1, 3.0)]) == (3.0, 0)  # 1, then +2 at 1 h, +1 at 3 h
    assert reservation(2, 3, [(4, 1.0)]) == (0.0, 1)  # it fits now: no wait
    with pytest.raises(ValueError, match="a job of 9 GPUs can never start: the cluster has 5"):
        reservation(9, 1, [(4, 1.0)])
