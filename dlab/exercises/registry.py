"""The exercises' register and the checkers' common tools: ``Exercise`` and ``exercise`` (the
decorator a checker registers with), ``Report``, ``first_difference``, and turning the
learner's function into source text to send to ranks and back into a function there."""
from __future__ import annotations

import html
import inspect
import linecache
import math
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    # on a rank: (log) -> {dist function name: (original) -> wrapper that logs into ``log``};
    # the judge then gets (answer, log) per rank: what the answer did, not only what it returned
    watch: Callable | None = None
    # the exercises whose answers this one is assembled from (train_zero1 calls the learner's
    # zero1_step): the learner passes their functions to ``check`` after the function, they are
    # sent with it, and the checker may run each piece's own check before the assembly's
    pieces: tuple[str, ...] = ()


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
    scope = {"torch": torch, "dist": dist, "math": math}
    exec(compile(source, "<exercise>", "exec"), scope)  # noqa: S102 - the learner's own code
    if name not in scope:
        raise NameError(f"the code defines no function {name!r}")
    return scope[name]
