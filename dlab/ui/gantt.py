"""The one Gantt chart: a timeline, one row per rank and a bar per event, for a measured step
of a run (the dashboard, ``run.plot()``) and for a schedule run on paper
(``dlab.theory.simulate``) alike, so the two can be drawn over each other.

Computations are full bars labelled with their micro-batch, hatched on a rank's second (and
later) virtual stage; collectives and the optimizer are bars of their own colour; with
``comm=True`` the time a rank spent blocked in a receive (or a send) is a thin red bar on top
of its row: where the bubble went.
"""
from __future__ import annotations

from dlab.core.events import COMPUTE
from dlab.ui.figure import kind_color, new_figure, style

WAITS = ("send", "recv")  # a pipeline's transfers: time spent waiting for a peer's data
WAIT_COLOR = "#d62728"  # red, apart from every kind's colour
WAITING = "waiting for a peer"  # their legend entry


def gantt(events: list[dict], ax=None, *, step: int | None = None, title: str | None = None,
          comm: bool = False, y_offset: float = 0.0, height: float = 0.8, alpha: float = 1.0,
          labels: bool = True, p: int | None = None):
    """Draw ``events`` (each with ``rank``, ``kind``, ``start``, ``end``; ``mb`` and ``stage``
    where they apply) on ``ax`` (a new figure's, if None) and return the figure.

    Events of several steps: ``step`` picks one (default: the last step every rank finished).
    ``comm``: draw the waits in transfers as thin red bars; otherwise transfers are left out.
    ``y_offset``, ``height``, ``alpha``: to overlay a second timeline on the same rows (a
    simulation under a measurement). ``p``: pipeline ranks, for hatching virtual stages >= p
    (default: the ranks drawn)."""
    events = _one_step(events, step)
    ranks = sorted({e["rank"] for e in events})
    if ax is None:
        ax = new_figure(figsize=(10, 0.6 + 0.5 * max(len(ranks), 1))).add_subplot()
    measured = any("step" in e for e in events)
    if not events:
        style(ax, title or "timeline (no finished step yet)", "seconds")
        return ax.figure
    t0 = min(e["start"] for e in events)
    p = p or len(ranks)
    shown = set()
    for e in events:
        kind, r, w = e["kind"], e["rank"], e["end"] - e["start"]
        if kind in WAITS:
            if comm and w > 0:
                ax.barh(r + y_offset - height / 2, w, left=e["start"] - t0, height=0.12,
                        color=WAIT_COLOR, alpha=alpha)
                shown.add(WAITING)
            continue
        ax.barh(r + y_offset, w, left=e["start"] - t0, height=height, color=kind_color(kind),
                edgecolor="white", linewidth=0.4, alpha=alpha,
                hatch="///" if kind in COMPUTE and e.get("stage", 0) >= p else None)
        shown.add(kind)
        if labels and kind in COMPUTE and "mb" in e and w > 0:
            ax.text(e["start"] - t0 + w / 2, r + y_offset, str(e["mb"]), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    if not ax.yaxis_inverted():  # a second call overlays on the same axes
        ax.invert_yaxis()
    default = (f"timeline of step {events[0]['step']} (numbers: micro-batch)" if measured
               else "")
    style(ax, default if title is None else title, "seconds" if measured else "time")
    _legend(ax, shown)
    return ax.figure


def _one_step(events: list[dict], step: int | None) -> list[dict]:
    """The events of one step (simulated events carry no step: all of them), without the
    loop's own "step" spans."""
    if not any("step" in e for e in events):
        return [e for e in events if e["kind"] != "step"]
    if step is None:
        ranks = {e["rank"] for e in events}
        done = [max((e["step"] for e in events if e["rank"] == r and e["kind"] == "step"),
                    default=None) for r in ranks]
        step = (min(done) if done and None not in done
                else max(e["step"] for e in events))
    return [e for e in events if e["step"] == step and e["kind"] != "step"]


def _legend(ax, shown: set[str]) -> None:
    """Explicit patches (an empty barh() gives the legend a handle without the bars' colour),
    right of the axes (below, a short axes' legend runs into its x label); one per kind drawn,
    merged with what an earlier call on these axes put there."""
    from matplotlib.patches import Patch  # matplotlib is imported by the first figure drawn

    known = {h.get_label(): h for h in (ax.get_legend().legend_handles if ax.get_legend() else [])}
    order = [*COMPUTE, "optimizer", "all_reduce", "all_gather", "reduce_scatter"]
    for kind in sorted(shown, key=lambda k: (order.index(k) if k in order else len(order), k)):
        if kind not in known:
            color = WAIT_COLOR if kind == WAITING else kind_color(kind)
            known[kind] = Patch(color=color, label=kind)
    ax.legend(handles=list(known.values()), fontsize=6, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
