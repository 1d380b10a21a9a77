"""The one figure factory and the look every figure shares.

Every figure of dlab is a ``matplotlib.figure.Figure`` that is not registered with pyplot, so a
notebook shows it once (as the cell's value) and never twice, and nothing leaks between cells.
matplotlib is imported on the first figure, not with ``dlab``: ranks import dlab and never
draw, and the lab extras (matplotlib, ipywidgets) are optional.
"""
from __future__ import annotations

import functools
import io
from typing import TYPE_CHECKING

from dlab.core.metrics import CATEGORIES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MiB = 2 ** 20
CATEGORY_COLORS = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"),
                           strict=True))
KIND_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "weight_grad": "#e5ae38",
               "send": "#8c8c8c", "recv": "#b5b5b5", "optimizer": "#55a868",
               "all_reduce": "#c44e52", "all_gather": "#8172b3", "reduce_scatter": "#937860"}


def kind_color(kind: str) -> str:
    return KIND_COLORS.get(kind, "#cccccc")


@functools.cache
def _figure_class():
    from matplotlib.figure import Figure  # here, on the first figure: the module docstring's reason

    class ShownFigure(Figure):
        """A Figure that a notebook shows as a PNG even where no pyplot backend registered a
        display formatter (a figure made outside pyplot otherwise prints as ``<Figure ...>``)."""

        def _repr_png_(self) -> bytes:
            return png(self, dpi=90)

    return ShownFigure


def new_figure(**kwargs) -> Figure:
    """A constrained-layout figure that shows itself in a notebook, outside pyplot."""
    return _figure_class()(layout="constrained", **kwargs)


def style(ax, title: str, xlabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def png(fig: Figure, dpi: int = 80) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
