"""Exercises that check themselves: the learner writes a function, ``check`` runs it (on N ranks
where the exercise is distributed) against a reference and says what is wrong.

::

    from dlab.exercises import check

    def ring_all_reduce(x, rank, world_size):
        ...                       # send/recv only

    check("ring_all_reduce", ring_all_reduce)

A distributed exercise's function is sent to N fresh ranks as its source text (so it must be
self-contained: ``torch``, ``dist`` and ``math`` are in scope, anything else is imported inside
it), run there on inputs the checker makes, and the ranks' answers come back to be compared
with what the reference gives on the same inputs. The report names the rank, the element or
step, and expected against got; a rank that raises is named with its exception. Where an
exercise says "send/recv only", the collectives are taken away from ``dist`` on the ranks. Where
the property taught is how the answer communicates (the ring's bytes per rank, ZeRO-1's
reduce-scatter and all-gather), the exercise wraps ``dist``'s functions on the ranks to log what
the answer called and sent, and the judge checks that too (``Exercise.watch``). An exercise that
assembles a strategy from earlier ones calls the learner's own pieces (``Exercise.pieces``), given
to ``check`` after the function: ``check("train_zero1", train_zero1, zero1_step)``.

Reference solutions live apart from the notebooks, in ``docs/instructor/solutions/`` (one file
per exercise, the instructor's to show), with notes per notebook in ``docs/instructor/``;
``tests/test_exercises.py`` runs every checker against its solution (it must pass) and against
a typical mistake (it must fail, saying what is wrong).
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch.distributed as dist

from dlab.analysis.diagnose import RunFailed
from dlab.exercises import (  # noqa: F401 - they register the exercises
    capstone,
    collectives,
    data_parallel,
    gpu,
    local,
    model_parallel,
    pipeline_assembled,
    planning,
    precision,
    scheduling,
    tp_assembled,
    zero,
)
from dlab.exercises.registry import COLLECTIVES, EXERCISES, Exercise, Report, define, source_of
from dlab.procs.spawn import spawn


def check(name: str, fn: Callable | str, *helpers: Callable, runs_dir: str = "runs",
          timeout_s: float = 30.0) -> Report:
    """Run the learner's ``fn`` (or source text defining a function called ``name``) for
    exercise ``name`` and say whether it is right, and if not, what is wrong. ``helpers``: the
    classes or functions ``fn`` uses, sent with it to the ranks."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}; there are: {', '.join(sorted(EXERCISES))}")
    ex = EXERCISES[name]
    source = source_of(fn, helpers)
    fname = name if isinstance(fn, str) else fn.__name__
    if "raise NotImplementedError" in source:
        unwritten = [h.__name__ for h in helpers if "raise NotImplementedError" in source_of(h)]
        if unwritten and "raise NotImplementedError" not in source_of(fn):
            one = len(unwritten) == 1
            return Report(name, False, f"not written yet: {', '.join(unwritten)}, which {fname} "
                                       f"uses, still {'raises' if one else 'raise'} "
                                       f"NotImplementedError; write and check "
                                       f"{'it' if one else 'them'} first, then {ex.task}")
        return Report(name, False, f"not written yet: {ex.task}")
    unsent = [u for u in ex.pieces if re.search(rf"\b{u}\s*\(", source)
              and not re.search(rf"^\s*def {u}\b", source, re.M)]
    if unsent:
        return Report(name, False, f"{fname} calls {unsent[0]}, which was not sent with it: pass "
                                   f"it to check after {fname}, as the exercise's cell does")
    if ex.ranks == 0:
        try:
            answer = ex.run(define(source, fname) if isinstance(fn, str) else fn)
        except Exception as e:  # noqa: BLE001 - the learner's error is the report
            return Report(name, False, f"raised {type(e).__name__}: {e}")
        wrong = ex.judge(answer)
    else:
        wrong = _distributed(ex, source, fname, runs_dir, timeout_s)
    return Report(name, wrong is None, wrong or f"matches the reference ({_where(ex)})")


def _where(ex: Exercise) -> str:
    return f"on {ex.ranks} ranks" if ex.ranks else "every case"


def _distributed(ex: Exercise, source: str, fname: str, runs_dir: str, timeout_s: float) -> str | None:
    try:
        answers = spawn(on_rank, ex.ranks, ex.name, source, fname, runs_dir=f"{runs_dir}/exercises",
                        name=ex.name, timeout_s=timeout_s)
    except RunFailed as failure:
        if failure.rank is None:
            return f"the ranks failed: {str(failure).splitlines()[0]}"
        return f"rank {failure.rank} raised {failure.exception}: {failure.message}"
    return ex.judge(answers)


def on_rank(name: str, source: str, fname: str):
    """On each rank: define the learner's function from its source and run the exercise."""
    ex = EXERCISES[name]
    fn = define(source, fname)
    taken, log = {}, {}
    if ex.p2p_only:
        for op in COLLECTIVES:
            taken[op] = getattr(dist, op)
            setattr(dist, op, _forbidden(op))
    for op, wrap in (ex.watch(log) if ex.watch else {}).items():
        if hasattr(dist, op):
            taken.setdefault(op, getattr(dist, op))
            setattr(dist, op, wrap(getattr(dist, op)))
    try:
        answer = ex.run(fn, dist.get_rank(), dist.get_world_size())
        return (answer, log) if ex.watch else answer
    finally:
        for op, f in taken.items():
            setattr(dist, op, f)


def _forbidden(op: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"dist.{op} is off limits in this exercise: build it from "
                           f"dist.send / dist.recv (or isend / irecv)")
    return refuse
