"""Pictures of what each collective moves where (notebook 02): every rank's chunks before and
after the operation, coloured by the rank they came from."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dlab.ui.figure import new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_SUB = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def _chunks(op: str, n: int, rank: int, after: bool) -> list[tuple[str, int | None]]:
    """What rank ``rank`` holds before / after ``op``: (label, origin rank or None if mixed).
    Rank r's input is x_r, split into n chunks x_r,c where the op splits data."""
    x = lambda r, c=None: (f"x{r}".translate(_SUB) + ("" if c is None else f",{c}".translate(_SUB)), r)
    total = lambda c=None: ("Σᵣxᵣ" + ("" if c is None else f",{c}".translate(_SUB)), None)
    if not after:
        if op in ("broadcast", "scatter"):
            if op == "scatter":
                return [x(0, c) for c in range(n)] if rank == 0 else [("", None)]
            return [x(0)] if rank == 0 else [("", None)]
        if op in ("reduce_scatter", "all_to_all"):
            return [x(rank, c) for c in range(n)]
        if op == "send_recv":
            return [x(0)] if rank == 0 else [("", None)]
        return [x(rank)]
    if op == "broadcast":
        return [x(0)]
    if op == "scatter":
        return [x(0, rank)]
    if op == "reduce":
        return [total()] if rank == 0 else [x(rank)]
    if op == "all_reduce":
        return [total()]
    if op == "all_gather":
        return [x(r) for r in range(n)]
    if op == "gather":
        return [x(r) for r in range(n)] if rank == 0 else [x(rank)]
    if op == "reduce_scatter":
        return [total(rank)]
    if op == "all_to_all":
        return [x(r, rank) for r in range(n)]
    if op == "send_recv":
        return [x(0)] if rank in (0, 1) else [("", None)]
    raise ValueError(f"unknown collective {op!r}; pick one of {COLLECTIVES}")


COLLECTIVES = ("broadcast", "scatter", "reduce", "all_reduce", "gather", "all_gather",
               "reduce_scatter", "all_to_all", "send_recv")


def collective_diagram(op: str, world_size: int = 4) -> Figure:
    """Before / after boxes for ``op`` on ``world_size`` ranks: one row per rank, a box per
    chunk it holds, coloured by the rank the data came from (grey: a sum over all ranks)."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; pick one of {COLLECTIVES}")
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
               "#8c8c8c"]
    fig = new_figure(figsize=(7, 0.5 + 0.45 * world_size))
    axes = fig.subplots(1, 2)
    for ax, after in zip(axes, (False, True), strict=True):
        for r in range(world_size):
            for c, (label, origin) in enumerate(_chunks(op, world_size, r, after)):
                if not label:
                    continue
                color = "#9e9e9e" if origin is None else palette[origin % len(palette)]
                ax.add_patch(_box(c, r, color))
                ax.text(c + 0.45, r + 0.4, label, ha="center", va="center", fontsize=8, color="white")
        ax.set_xlim(-0.1, world_size + 0.1)
        ax.set_ylim(world_size, -0.2)
        ax.set_yticks([r + 0.4 for r in range(world_size)], [f"rank {r}" for r in range(world_size)],
                      fontsize=8)
        ax.set_xticks([])
        ax.set_frame_on(False)
        ax.set_title("after" if after else "before", fontsize=9)
    fig.suptitle(op.replace("_", "-"), fontsize=10)
    return fig


def _box(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle
    return Rectangle((x, y), 0.9, 0.8, facecolor=color, edgecolor="white")
