"""Where every rank of a layout sits and which ranks form each group: pure arithmetic on the
mesh's degrees, no process group. ``dlab.parallel.mesh.Mesh`` creates the process groups from
exactly these lists, so the same degrees place the same ranks in every strategy, and a test can
check a layout's groups without starting a process.

Ranks are laid out row-major over the dimensions in order (the last varies fastest):
``coords`` and ``rank_at`` convert. A group over some dimensions is the set of ranks that share
every other coordinate (``groups``); ``select`` keeps only some coordinates of a grouped
dimension (the first and the last pipeline stage, which hold the tied embedding); ``folded``
cuts the ranks of some dimensions into consecutive runs (expert parallelism folded onto the data
ranks, Ulysses groups inside a context-parallel ring).
"""
from __future__ import annotations

import itertools
import math


def coords(dims: dict[str, int], rank: int) -> dict[str, int]:
    """The coordinates of ``rank`` (row-major over ``dims``, the last fastest)."""
    out = {}
    for d in reversed(list(dims)):
        rank, out[d] = divmod(rank, dims[d])
    return {d: out[d] for d in dims}


def rank_at(dims: dict[str, int], at: dict[str, int]) -> int:
    """The rank at coordinates ``at``."""
    rank = 0
    for d, n in dims.items():
        rank = rank * n + at[d]
    return rank


def groups(dims: dict[str, int], over: tuple[str, ...],
           select: dict[str, tuple[int, ...]] | None = None) -> list[list[int]]:
    """Every group over the dimensions ``over``: the ranks sharing all other coordinates, in
    increasing order, one list per combination of the other coordinates (in row-major order of
    those). ``select`` keeps only the given coordinates of a dimension in ``over``."""
    select = select or {}
    others = [d for d in dims if d not in over]
    out = []
    for fixed in itertools.product(*(range(dims[d]) for d in others)):
        base = dict(zip(others, fixed, strict=True))
        free = itertools.product(*(select.get(d, range(dims[d])) for d in over))
        out.append(sorted(rank_at(dims, {**base, **dict(zip(over, f, strict=True))}) for f in free))
    return out


def folded(dims: dict[str, int], over: tuple[str, ...], inner: int
           ) -> tuple[list[list[int]], list[list[int]]]:
    """A dimension of ``inner`` ranks folded onto ``over``: each group over ``over`` (ranks in
    row-major order of those dimensions) cut into consecutive runs of ``inner`` ranks (the
    folded groups), and the ranks at the same place of each run (the groups across them)."""
    runs, across = [], []
    for ranks in groups(dims, over):
        runs += [ranks[k:k + inner] for k in range(0, len(ranks), inner)]
        across += [ranks[j::inner] for j in range(inner)]
    return runs, across


def group_of(all_groups: list[list[int]], rank: int) -> list[int] | None:
    """The group of ``all_groups`` that holds ``rank`` (None: it is in none)."""
    return next((g for g in all_groups if rank in g), None)


def world(dims: dict[str, int]) -> int:
    return math.prod(dims.values())
