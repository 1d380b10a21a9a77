"""Static figures of runs, read from their run directories: the dashboard's panels, ``plot``
for one run after the fact, ``compare`` for several side by side, and ``collective_diagram``
for what a collective moves where.

Every function returns a ``matplotlib.figure.Figure`` that is not registered with pyplot, so a
notebook shows it once (as the cell's value) and never twice, and nothing leaks between cells.

Definitions are those of ``dlab.summary``: step time and tokens/s are medians over the steps
after the first; memory is each category's peak; bytes moved are what a rank sent per step.
Bubble fraction follows the pipeline papers (GPipe, Huang et al. 2019; 1F1B, Narayanan et al.
2019): for one step, the window runs from the first compute event on any rank to the last one;
a rank's bubble is the part of that window in which it computes nothing.
"""
from __future__ import annotations

import functools
import io
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from dlab.metrics import CATEGORIES
from dlab.timeline import busy_fraction

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MiB = 2 ** 20
COMPUTE = ("forward", "backward", "weight_grad")
CATEGORY_COLORS = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"), strict=True))
KIND_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "weight_grad": "#e5ae38",
               "send": "#8c8c8c", "recv": "#b5b5b5", "optimizer": "#55a868",
               "all_reduce": "#c44e52", "all_gather": "#8172b3", "reduce_scatter": "#937860"}


@functools.cache
def _figure_class():
    from matplotlib.figure import Figure

    class ShownFigure(Figure):
        """A Figure that a notebook shows as a PNG even where no pyplot backend registered a
        display formatter (a figure made outside pyplot otherwise prints as ``<Figure ...>``)."""

        def _repr_png_(self) -> bytes:
            return png(self, dpi=90)

    return ShownFigure


def new_figure(**kwargs) -> Figure:
    """matplotlib is imported here, on the first figure, not with ``dlab``: ranks import dlab
    and never draw, and the lab extras (matplotlib, ipywidgets) are optional."""
    return _figure_class()(layout="constrained", **kwargs)


# --- reading --------------------------------------------------------------------------------
def as_run(run):
    """A ``Run`` from a ``Run`` or a run directory's path."""
    if isinstance(run, (str, Path)):
        from dlab.launch import attach
        return attach(run)
    return run


def run_label(run) -> str:
    cfg = run.config
    return cfg.get("name") or f"{cfg.get('strategy', '?')} x{cfg.get('world_size', '?')}"


def bubble_fractions(events: list[dict]) -> dict[int, float]:
    """Mean bubble fraction per rank over the steps after the first (all steps if only one).

    ``events`` are timeline events of all ranks (each with ``rank``); only compute events
    (forward, backward, weight_grad) count as busy."""
    by_step: dict[int, dict[int, list[dict]]] = {}
    for e in events:
        if e["kind"] in COMPUTE:
            by_step.setdefault(e["step"], {}).setdefault(e["rank"], []).append(e)
    steps = sorted(by_step)[1:] or sorted(by_step)
    out: dict[int, list[float]] = {}
    for s in steps:
        ranks = by_step[s]
        start = min(e["start"] for evs in ranks.values() for e in evs)
        end = max(e["end"] for evs in ranks.values() for e in evs)
        if end <= start:
            continue
        for r, evs in ranks.items():
            busy, _ = busy_fraction(evs, COMPUTE)
            out.setdefault(r, []).append(1 - busy / (end - start))
    return {r: statistics.mean(v) for r, v in sorted(out.items())}


def restarts(events: list[dict]) -> list[tuple[int, int]]:
    """``(attempt, step it resumed from)`` for each time torchrun restarted the ranks after a
    fault (the worker's "restart" timeline event; every rank writes one, shown once)."""
    return sorted({(e["attempt"], e["from_step"]) for e in events if e["kind"] == "restart"})


def is_pipeline(events: list[dict]) -> bool:
    return any("stage" in e for e in events)


# --- the dashboard's panels -------------------------------------------------------------------
def draw_run(fig: Figure, metrics: dict[int, list[dict]], events: list[dict], title: str = "") -> None:
    """Draw a run's panels into ``fig`` (cleared first): per rank, loss, throughput, memory
    by category, bytes moved, step time; for a pipeline, bubble fraction and the Gantt chart
    of the last step every rank finished."""
    fig.clear()
    pipeline = is_pipeline(events)
    grid = fig.add_gridspec(3 if pipeline else 2, 3)
    ranks = sorted(metrics)
    series = lambda r, key: ([m["step"] for m in metrics[r]], [key(m) for m in metrics[r]])

    ax = fig.add_subplot(grid[0, 0])
    for r in ranks:
        ax.plot(*series(r, lambda m: m["loss"]), label=f"rank {r}", lw=1.2)
    for attempt, step in restarts(events):
        ax.axvline(step, color="#d62728", lw=1, ls=":",
                   label=f"restart {attempt}: resumed at step {step}")
    _style(ax, "loss (global mean)", "step")
    if ranks:
        ax.legend(fontsize=7, loc="upper right")

    ax = fig.add_subplot(grid[0, 1])
    for r in ranks:
        ax.plot(*series(r, lambda m: m["tokens_per_s"]), lw=1.2)
    _style(ax, "throughput (tokens/s)", "step")

    ax = fig.add_subplot(grid[0, 2])
    memory_bars(ax, {f"r{r}": peak_memory(metrics[r]) for r in ranks})
    _style(ax, "memory by category (peak MiB)", "rank")
    if ranks:
        ax.legend(fontsize=6, loc="upper right")

    ax = fig.add_subplot(grid[1, 0])
    for r in ranks:
        steps, sent = series(r, lambda m: m["comm"]["sent_bytes"] / MiB)
        ax.plot(steps, _cumsum(sent), lw=1.2)
    _style(ax, "communication: MiB sent (cumulative)", "step")

    ax = fig.add_subplot(grid[1, 1])
    for r in ranks:
        ax.plot(*series(r, lambda m: 1e3 * m["step_time"]), lw=1.2)
    _style(ax, "step time (ms)", "step")

    ax = fig.add_subplot(grid[1, 2])
    for r in ranks:
        ax.plot(*series(r, lambda m: 100 * m["comm"]["seconds"] / m["step_time"]), lw=1.2)
    _style(ax, "time in collectives (% of step)", "step")

    if pipeline:
        ax = fig.add_subplot(grid[2, 0])
        bubbles = bubble_fractions(events)
        ax.bar([f"r{r}" for r in bubbles], [100 * b for b in bubbles.values()], color="#8c8c8c")
        _style(ax, "bubble (% of step, mean)", "rank")
        gantt(fig.add_subplot(grid[2, 1:]), events)
    if title:
        fig.suptitle(title, fontsize=10)


def gantt(ax, events: list[dict], step: int | None = None) -> None:
    """Per-rank timeline of one step (default: the last step every rank finished): one row
    per rank, one bar per event, forward/backward bars labelled with their micro-batch."""
    ranks = sorted({e["rank"] for e in events})
    done = [max((e["step"] for e in events if e["rank"] == r and e["kind"] == "step"), default=-1)
            for r in ranks]
    step = min(done, default=-1) if step is None else step
    shown = [e for e in events if e["step"] == step and e["kind"] != "step"]
    if not shown:
        _style(ax, "timeline (no finished step yet)", "seconds")
        return
    t0 = min(e["start"] for e in shown)
    for e in shown:
        y, w = e["rank"], e["end"] - e["start"]
        ax.barh(y, w, left=e["start"] - t0, height=0.7, color=KIND_COLORS.get(e["kind"], "#cccccc"),
                edgecolor="white", linewidth=0.4)
        if "mb" in e and e["kind"] in COMPUTE:
            ax.text(e["start"] - t0 + w / 2, y, str(e["mb"]), ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    present = {e["kind"] for e in shown}
    kinds = [k for k in KIND_COLORS if k in present] + sorted(present - set(KIND_COLORS))
    for k in kinds:
        ax.barh([], [], color=KIND_COLORS.get(k, "#cccccc"), label=k)
    ax.legend(fontsize=6, loc="upper right", ncols=len(kinds))
    _style(ax, f"timeline of step {step} (numbers: micro-batch)", "seconds")


def peak_memory(records: list[dict]) -> dict[str, float]:
    return {c: max((m["memory"].get(c, 0) for m in records), default=0) for c in CATEGORIES}


def memory_bars(ax, memory: dict[str, dict[str, float]], offset: float = 0.0, width: float = 0.8,
                legend: bool = True) -> None:
    """Stacked bars, one per key of ``memory`` ({label: {category: bytes}}), in MiB."""
    labels = list(memory)
    xs = [offset + i for i in range(len(labels))]
    bottom = [0.0] * len(labels)
    for c in CATEGORIES:
        values = [memory[k].get(c, 0) / MiB for k in labels]
        ax.bar(xs, values, width, bottom=bottom, color=CATEGORY_COLORS[c],
               label=c if legend else None)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(xs, labels)


def _cumsum(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


def _style(ax, title: str, xlabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def png(fig: Figure, dpi: int = 80) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


# --- after the fact ---------------------------------------------------------------------------
def plot(run) -> Figure:
    """The dashboard's final figure of a run (a ``Run`` or a run directory)."""
    run = as_run(run)
    metrics = {r: run.metrics(r) for r in run.dir.ranks()}
    events = run.timeline()
    fig = new_figure(figsize=(12, 9 if is_pipeline(events) else 6.2))
    draw_run(fig, metrics, events, f"{run.path.name}: {run.state}")
    return fig


def compare(runs) -> Figure:
    """Runs side by side: step time, tokens/s, memory per rank by category, bytes moved per
    step. ``runs`` is a list of ``Run`` objects or run directories."""
    runs = [as_run(r) for r in runs]
    if not runs:
        raise ValueError("compare() needs at least one run")
    summaries = [r.summary() for r in runs]
    labels = [run_label(r) for r in runs]
    fig = new_figure(figsize=(12, 7))
    axes = fig.subplots(2, 2)
    for ax, key, scale, title in ((axes[0, 0], "step_time_s", 1e3, "step time (ms, median)"),
                                  (axes[0, 1], "tokens_per_s", 1, "throughput (tokens/s, median)")):
        for i, s in enumerate(summaries):
            values = [row[key] * scale for row in s.rows if row["steps"]]
            ax.bar(i, statistics.median(values) if values else 0, 0.6, color="#c9d6ea")
            ax.plot([i] * len(values), values, "o", ms=3, color="#4c72b0")
        ax.set_xticks(range(len(labels)), labels)
        _style(ax, title + " - dots: ranks", "")

    ax, x = axes[1, 0], 0.0
    ticks, names = [], []
    for i, s in enumerate(summaries):
        mem = {f"r{row['rank']}": row["memory"] for row in s.rows if row["steps"]}
        memory_bars(ax, mem, offset=x, legend=i == 0)
        ticks += [x + j for j in range(len(mem))]
        names += [f"{labels[i]}\n{k}" if j == 0 else k for j, k in enumerate(mem)]
        x += len(mem) + 1
    ax.set_xticks(ticks, names, fontsize=6)
    ax.legend(fontsize=6)
    _style(ax, "memory per rank by category (peak MiB)", "")

    ax = axes[1, 1]
    width = 0.8 / max(len(s.rows) for s in summaries)
    for i, s in enumerate(summaries):
        for j, row in enumerate(s.rows):
            if row["steps"]:
                ax.bar(i - 0.4 + (j + 0.5) * width, row["comm_sent_per_step"] / MiB, width,
                       color="#c44e52", edgecolor="white")
    ax.set_xticks(range(len(labels)), labels)
    _style(ax, "MiB sent per step (one bar per rank)", "")
    return fig


# --- what a collective moves where ------------------------------------------------------------
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
