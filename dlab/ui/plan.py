"""The planner's figures and controls (notebook 11): a layout's memory and time as stacked bars,
and the explorer's controls in rows that fit a laptop's window.

The bars are read by a learner comparing *their* layout with the search's best, so the first
bar is labelled as theirs and drawn at the top, every legend sits below its panel (a legend
inside the axes covers the bars it names, and the memory limit's line), and the limit is named
in the legend. The figure is ``dlab.ui.figure``'s constrained-layout figure, sized from the
number of bars, so a one-bar chart draws without a layout warning.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import ipywidgets as W

from dlab.ui.figure import new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GB = 1e9
# the parts of a Prediction's dicts that are not a bar segment: the sum, and which rank it is
NOT_A_PART = ("total", "pp_rank")
MEMORY_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
TIME_COLORS = ("#2a9d8f", "#81b29a", "#e9c46a", "#f4a261", "#b56576", "#6d597a", "#9b2226",
               "#3d405b", "#264653", "#8d99ae")


def bar_labels(preds, first: str | None = None) -> list[str]:
    """One label per bar, never two alike (matplotlib would draw equal category names on one
    row): ``first`` names the first bar ("yours"), the others are numbered in rank order; a
    lone bar is its layout's name."""
    if len(preds) == 1 and not first:
        return [preds[0].layout.describe()]
    labels = []
    for i, q in enumerate(preds):
        name = q.layout.describe()
        if first and i == 0:
            labels.append(f"{first}: {name}")
        else:
            labels.append(f"{i if first else i + 1}. {name}")
    return labels


def layout_bars(preds, title: str, first: str | None = None) -> Figure:
    """Memory per GPU and time per step of each prediction, by part, side by side.

    ``first`` labels the first prediction (e.g. "yours") and the rest are numbered; the dashed
    line is the memory a GPU gives to tensors (``Prediction.capacity``)."""
    fig = new_figure(figsize=(11, 1.5 + 0.42 * len(preds)))
    # a panel per subfigure, so each legend goes below its own panel and the layout makes room
    left_fig, right_fig = fig.subfigures(1, 2, width_ratios=(1.15, 1))
    ax_mem = left_fig.subplots()
    ax_time = right_fig.subplots(sharey=ax_mem)
    labels = bar_labels(preds, first)
    rows = list(range(len(preds)))
    # a colour per part, fixed (a part keeps its colour as the explorer's layouts change) and
    # never shared between a memory part and a time part
    for ax, parts, unit, xlabel, palette in (
            (ax_mem, "memory", GB, "GB per GPU", MEMORY_COLORS),
            (ax_time, "time", 1.0, "seconds per step", TIME_COLORS)):
        left = [0.0] * len(preds)
        keys = [k for k in getattr(preds[0], parts) if k not in NOT_A_PART]
        for key, color in zip(keys, palette, strict=True):
            values = [getattr(q, parts)[key] / unit for q in preds]
            if any(values):
                ax.barh(rows, values, left=left, label=key, color=color)
                left = [x + v for x, v in zip(left, values)]
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    ax_mem.axvline(preds[0].capacity / GB, color="k", ls="--", lw=1, label="GPU memory for tensors")
    ax_mem.set_yticks(rows, labels)
    ax_mem.invert_yaxis()  # the first prediction on top, read first (sharey inverts both)
    ax_time.tick_params(labelleft=False)
    for sub, ax in ((left_fig, ax_mem), (right_fig, ax_time)):
        sub.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=7,
                   frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


def control_rows(controls, per_row: int = 4, width: str = "245px"):
    """The controls as rows of ``per_row``, each ``width`` wide with a short description, so
    twelve controls fit a 1,400-pixel window beside JupyterLab's side bar (ipywidgets' default,
    300 pixels each, makes a row of six scroll sideways)."""
    controls = list(controls)
    for c in controls:
        c.layout.width = width
        # each description as wide as its words: a slider keeps the rest for its track
        c.style.description_width = f"{8 * len(c.description) + 12}px"
    return W.VBox([W.HBox(controls[i:i + per_row]) for i in range(0, len(controls), per_row)])
