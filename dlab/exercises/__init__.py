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
exercise says "send/recv only", the collectives are taken away from ``dist`` on the ranks.

Reference solutions live apart from the notebooks, in ``docs/instructor/solutions/`` (one file
per exercise, the instructor's to show), with notes per notebook in ``docs/instructor/``;
``tests/test_exercises.py`` runs every checker against its solution (it must pass) and against
a typical mistake (it must fail, saying what is wrong).
"""
from __future__ import annotations

import html
import inspect
import linecache
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
               "all_gather_into_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single",
               "scatter", "gather")


@dataclass
class Exercise:
    name: str
    notebook: str
    task: str  # one line: what to write
    run: Callable  # on a rank: (fn, rank, world) -> answer; with ranks == 0: (fn) -> answer
    judge: Callable  # (answers: one per rank, or the one answer) -> what is wrong, or None
    ranks: int = 0  # 0: run in the notebook's own process
    p2p_only: bool = False  # the collectives are taken away on the ranks


EXERCISES: dict[str, Exercise] = {}


def exercise(**fields) -> Callable:
    """Register the decorated ``judge`` under ``fields["name"]``."""
    def register(judge):
        EXERCISES[fields["name"]] = Exercise(judge=judge, **fields)
        return judge
    return register


@dataclass
class Report:
    exercise: str
    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"{self.exercise}: {'correct' if self.ok else 'not yet'} - {self.message}"

    def _repr_html_(self) -> str:
        colour, mark = ("#2ca02c", "&#10004; correct") if self.ok else ("#d62728", "&#10008; not yet")
        return (f"<div style='border-left:4px solid {colour};padding:4px 8px'><b style='color:"
                f"{colour}'>{self.exercise}: {mark}</b><pre style='margin:2px 0;white-space:pre-wrap'>"
                f"{html.escape(self.message)}</pre></div>")


def first_difference(got, want, what: str = "", atol: float = 1e-5) -> str | None:
    """Where two tensors (or sequences of numbers) first differ, said as expected against got;
    None when they agree to ``atol`` (relative 1e-5 too)."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    prefix = f"{what}: " if what else ""
    if got.shape != want.shape:
        return f"{prefix}shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    close = torch.isclose(got.double(), want.double(), rtol=1e-5, atol=atol)
    if bool(close.all()):
        return None
    i = tuple(int(j) for j in (~close).nonzero()[0])
    where = f"element {i[0] if len(i) == 1 else i}"
    return f"{prefix}{where}: expected {want[i].item():g}, got {got[i].item():g}"


def source_of(fn: Callable | str, helpers=()) -> str:
    """The code to send: the helpers' source (a class, a function the answer calls), then the
    function's; or ``fn`` itself when it is already source text."""
    if isinstance(fn, str):
        return textwrap.dedent(fn)
    return "\n\n".join(textwrap.dedent(_source(f)) for f in (*helpers, fn))


def _source(obj) -> str:
    """``inspect.getsource``, and for a class defined in a notebook cell (which ``inspect``
    cannot find: ``__main__`` has no file) the class's block in its methods' cell."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        if not inspect.isclass(obj):
            raise
    for attr in vars(obj).values():
        code = getattr(getattr(attr, "__func__", attr), "__code__", None)
        if code is None:
            continue
        lines = linecache.getlines(code.co_filename)
        for i in range(code.co_firstlineno - 1, -1, -1):
            if re.match(rf"\s*class {obj.__name__}\b", lines[i]):
                return "".join(inspect.getblock(lines[i:]))
    raise OSError(f"cannot find the source of {obj.__name__}: pass the code as a string instead")


def define(source: str, name: str) -> Callable:
    """``name`` as ``source`` defines it, with ``torch``, ``dist`` and ``math`` in scope."""
    import math

    import torch.distributed as dist

    scope = {"torch": torch, "dist": dist, "math": math}
    exec(compile(source, "<exercise>", "exec"), scope)  # noqa: S102 - the learner's own code
    if name not in scope:
        raise NameError(f"the code defines no function {name!r}")
    return scope[name]


def check(name: str, fn: Callable | str, *helpers: Callable, runs_dir: str = "runs",
          timeout_s: float = 30.0) -> Report:
    """Run the learner's ``fn`` (or source text defining a function called ``name``) for
    exercise ``name`` and say whether it is right, and if not, what is wrong. ``helpers``: the
    classes or functions ``fn`` uses, sent with it to the ranks."""
    from dlab.exercises import catalogue  # noqa: F401 - registers the exercises

    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}; there are: {', '.join(sorted(EXERCISES))}")
    ex = EXERCISES[name]
    source = source_of(fn, helpers)
    fname = name if isinstance(fn, str) else fn.__name__
    if "raise NotImplementedError" in source:
        return Report(name, False, f"not written yet: {ex.task}")
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
    from dlab.analysis.diagnose import RunFailed
    from dlab.procs.spawn import spawn

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
    import torch.distributed as dist

    from dlab.exercises import catalogue  # noqa: F401

    ex = EXERCISES[name]
    fn = define(source, fname)
    taken = {}
    if ex.p2p_only:
        for op in COLLECTIVES:
            taken[op] = getattr(dist, op)
            setattr(dist, op, _forbidden(op))
    try:
        return ex.run(fn, dist.get_rank(), dist.get_world_size())
    finally:
        for op, f in taken.items():
            setattr(dist, op, f)


def _forbidden(op: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"dist.{op} is off limits in this exercise: build it from "
                           f"dist.send / dist.recv (or isend / irecv)")
    return refuse
