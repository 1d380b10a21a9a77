"""Static figures of runs, read from their run directories: the dashboard's panels, ``plot``
for one run after the fact, ``compare`` for several side by side. Every function returns a
figure of ``dlab.ui.figure`` (outside pyplot: shown once, as the cell's value).

Definitions are those of ``dlab.analysis.summary``: step time and tokens/s are medians over the steps
after the first; memory is each category's peak; bytes are what a rank sent per step, counted
two ways and named apart: "model (ring)" is ``Comm``'s count of the bandwidth-optimal algorithm
(``sent_bytes``), "measured (wire)" what the transport wrote (``wire_bytes``, where a run has it).

Theory beside measurement, asked of the run's strategy (``dlab.ui.theory``): the memory bars set
the model state the strategy predicts beside the measured one, and for a run that pipelines
(``pipeline-*``, ``nd`` with pp > 1) the bubble panel sets the schedule's closed form
(``dlab.theory.pipeline``) and its replay on paper with the run's op times
(``dlab.theory.simulate``) beside the measured bubble (``dlab.core.events.bubble_fractions``);
each is labelled "(model)".
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from dlab.analysis.reader import open_run
from dlab.analysis.steps import bubble_fractions, peak_memory, steady, wire_per_step
from dlab.core.events import COMPUTE
from dlab.core.metrics import CATEGORIES
from dlab.theory.simulate import replay, replay_ops
from dlab.ui.figure import CATEGORY_COLORS, MiB, new_figure, style
from dlab.ui.gantt import gantt
from dlab.ui.theory import PipelineView, bubble_formula, model_state, pipeline_view

if TYPE_CHECKING:
    from matplotlib.figure import Figure


# --- reading --------------------------------------------------------------------------------
def as_run(run):
    """A run to read: ``run`` itself (a ``Run`` or ``RunView``), or a run directory's path."""
    if isinstance(run, (str, Path)):
        return open_run(run)
    return run


def run_label(run) -> str:
    cfg = run.config
    return cfg.get("name") or f"{cfg.get('strategy', '?')} x{cfg.get('world_size', '?')}"


def restarts(events: list[dict]) -> list[tuple[int, int]]:
    """``(attempt, step it resumed from)`` for each time torchrun restarted the ranks after a
    fault (the worker's "restart" timeline event; every rank writes one, shown once)."""
    return sorted({(e["attempt"], e["from_step"]) for e in events if e["kind"] == "restart"})


def is_pipeline(events: list[dict]) -> bool:
    return any("stage" in e for e in events)


# --- theory for a run's config (``dlab.ui.theory``) -----------------------------------------
BUBBLE_COLORS = {"measured": "#8c8c8c", "simulated (model), measured op times": "#4c72b0",
                 "simulated (model), mean op times": "#a1c1e6"}




def simulated_bubbles(layout: PipelineView, events: list[dict]) -> dict[str, dict[int, float]]:
    """Per rank, the bubble of the schedule run on paper (``simulate.py``: communication free)
    with this run's own op times, two ways: each op taking the time it took, and every op its
    kind's mean. Each pipeline is replayed from its own events, in the steps where it ran every
    computation of the schedule (a live run's unfinished step is left out), and averaged as
    ``bubble_fractions`` averages the measurement."""
    sched = layout.schedule
    wanted = {(a.kind, a.stage, a.mb) for acts in sched.actions for a in acts if a.is_compute}
    by_op, by_mean = [], []
    for ranks in layout.pipelines:
        pp_rank = {g: i for i, g in enumerate(ranks)}
        mine = [dict(e, rank=pp_rank[e["rank"]]) for e in events
                if e["kind"] in COMPUTE and e["rank"] in pp_rank]
        steps = [s for s in sorted({e["step"] for e in mine})
                 if {(e["kind"], e["stage"], e["mb"]) for e in mine if e["step"] == s} == wanted]
        for s in steps:
            by_op += _placed(replay_ops(sched, [e for e in mine if e["step"] == s]), ranks, s)
        if steps:
            counted = set(steady(steps))  # the mean op times of the steps the measured bars count
            by_mean += _placed(replay(sched, [e for e in mine if e["step"] in counted]), ranks, 0)
    out = {"simulated (model), measured op times": bubble_fractions(by_op),
           "simulated (model), mean op times": bubble_fractions(by_mean)}
    return {label: values for label, values in out.items() if values}


def _placed(simulated: list[dict], ranks: list[int], step: int) -> list[dict]:
    """Simulated events (ranks numbered within their pipeline) on the global ranks ``ranks``."""
    return [dict(e, rank=ranks[e["rank"]], step=step) for e in simulated]


def draw_run(fig: Figure, metrics: dict[int, list[dict]], events: list[dict], title: str = "",
             config: dict | None = None) -> None:
    """Draw a run's panels into ``fig`` (cleared first): per rank, loss, throughput, memory
    by category, bytes sent, step time; for a pipeline, bubble fraction and the Gantt chart
    of the last step every rank finished. With the run's ``config`` the panels that have a
    theory draw it beside the measurement: the model state ``dlab.theory`` predicts, the
    schedule's bubble formula and its simulation."""
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
    style(ax, "loss (global mean)", "step")
    if ranks:
        ax.legend(fontsize=7, loc="upper right")

    ax = fig.add_subplot(grid[0, 1])
    for r in ranks:
        ax.plot(*series(r, lambda m: m["tokens_per_s"]), lw=1.2)
    style(ax, "throughput (tokens/s)", "step")

    memory_panel(fig.add_subplot(grid[0, 2]), metrics, config)
    bytes_panel(fig.add_subplot(grid[1, 0]), metrics)

    ax = fig.add_subplot(grid[1, 1])
    for r in ranks:
        ax.plot(*series(r, lambda m: 1e3 * m["step_time"]), lw=1.2)
    style(ax, "step time (ms)", "step")

    ax = fig.add_subplot(grid[1, 2])
    for r in ranks:
        line = ax.plot(*series(r, lambda m: 100 * m["comm"].get("exposed_seconds", float("nan"))
                                / m["step_time"]), lw=1.2)
        ax.plot(*series(r, lambda m: 100 * m["comm"].get("busy_seconds", float("nan"))
                        / m["step_time"]), lw=1.0, ls=":", color=line[0].get_color())
    style(ax, "comm exposed (solid) and busy (dotted), % of step", "step")

    if pipeline:
        bubble_panel(fig.add_subplot(grid[2, 0]), events, config)
        gantt(events, fig.add_subplot(grid[2, 1:]), comm=True)
    if title:
        fig.suptitle(title, fontsize=10)


def memory_panel(ax, metrics: dict[int, list[dict]], config: dict | None) -> None:
    """Each rank's measured peak by category; beside it, hatched, the model state (parameters,
    gradients, optimizer state) ``dlab.theory`` predicts for that rank, where it has a
    formula for the run's strategy."""
    ranks = sorted(metrics)
    modelled = beside_model(ax, {f"r{r}": peak_memory(metrics[r]) for r in ranks},
                            predicted_states(config, ranks))
    style(ax, "memory by category (peak MiB)", "rank")
    if ranks:
        memory_legend(ax, modelled, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def predicted_states(config: dict | None, ranks) -> dict[str, dict[str, int]]:
    """``model_state`` of each rank that has one, keyed like the memory bars ("r0", ...)."""
    states = {f"r{r}": model_state(config, r) for r in ranks} if config else {}
    return {label: state for label, state in states.items() if state is not None}


def beside_model(ax, memory: dict[str, dict[str, float]], model: dict[str, dict[str, float]],
                 offset: float = 0.0, legend: bool = True) -> bool:
    """Measured stacked bars, one per label of ``memory``, at ``offset``, ``offset`` + 1, ...;
    beside those ``model`` has a label for, hatched, the predicted model state. True if any
    model bar was drawn."""
    width = 0.4 if model else 0.8
    memory_bars(ax, memory, offset=offset - (width / 2 if model else 0.0), width=width, legend=legend)
    for i, label in enumerate(memory):
        if label in model:
            _stack(ax, offset + i + width / 2, model[label], width, hatch="////", alpha=0.45,
                   gid="model")
    ax.set_xticks([offset + i for i in range(len(memory))], list(memory))
    return bool(model)


def memory_legend(ax, modelled: bool, **where) -> None:
    """The categories' colours, and which bars are measured and which the model, if both."""
    from matplotlib.patches import Patch
    handles, _ = ax.get_legend_handles_labels()
    if modelled:
        handles += [Patch(facecolor="#bbbbbb", label="solid: measured"),
                    Patch(facecolor="white", edgecolor="#555555", hatch="////",
                          label="hatched: model state (model)")]
    ax.legend(handles=handles, fontsize=6, **where)


def bytes_panel(ax, metrics: dict[int, list[dict]]) -> None:
    """Cumulative bytes each rank sent: the ring-model count that ``Comm`` records (solid) and,
    where the transport let the rank see them, the bytes it measured on the wire (dashed, same
    colour). Runs without wire counts (NCCL, older runs) show the model and say so."""
    measured_any = False
    for i, r in enumerate(sorted(metrics)):
        steps = [m["step"] for m in metrics[r]]
        color = f"C{i % 10}"
        model = [m["comm"]["sent_bytes"] / MiB for m in metrics[r]]
        ax.plot(steps, _cumsum(model), lw=1.2, color=color, label="model (ring)" if i == 0 else None)
        wire = [m["comm"].get("wire_bytes") for m in metrics[r]]
        if wire and all(w is not None for w in wire):
            ax.plot(steps, _cumsum([w / MiB for w in wire]), lw=1.2, ls="--", color=color,
                    label=None if measured_any else "measured (wire)")
            measured_any = True
    style(ax, "communication: MiB sent (cumulative)", "step")
    if not metrics:
        return
    if not measured_any:
        ax.text(0.02, 0.78, "wire bytes: not measured", transform=ax.transAxes, fontsize=7,
                color="#555555")
    ax.legend(fontsize=6, loc="upper left")


def bubble_panel(ax, events: list[dict], config: dict | None) -> None:
    """Per rank, the measured bubble beside the schedule's simulation with the run's own op
    times (each op as measured, then all at their mean), and the closed form as a line. The
    gaps between them: jitter (formula -> each op's time) and communication plus dispatch
    (simulation -> measured)."""
    measured = bubble_fractions(events)
    ranks = list(measured)
    layout = pipeline_view(config) if config else None
    sims = simulated_bubbles(layout, events) if layout else {}
    columns = {"measured": measured, **sims}
    width = 0.8 / len(columns)
    for j, (label, values) in enumerate(columns.items()):
        xs = [i - 0.4 + (j + 0.5) * width for i, r in enumerate(ranks) if r in values]
        ax.bar(xs, [100 * values[r] for r in ranks if r in values], width,
               color=BUBBLE_COLORS[label], label=label)
    formula = bubble_formula(layout) if layout else None
    if formula is not None:
        # the zero-bubble forms depend on the op times; dlab's are written for equal ones
        equal = " at t_F = t_B = t_W" if layout.schedule.split_backward else ""
        ax.axhline(100 * formula, color="#c44e52", ls="--", lw=1.2,
                   label=f"formula (model): {100 * formula:.1f}%{equal}")
    ax.set_xticks(range(len(ranks)), [f"r{r}" for r in ranks])
    tallest = max([100 * x for values in columns.values() for x in values.values()]
                  + [100 * formula if formula is not None else 0.0])
    ax.set_ylim(0, 1.2 * tallest or 1.0)  # room above the formula's line
    s = layout.schedule if layout else None
    what = f": {s.name} p={s.p} m={s.m}" if s else ""
    what += f" v={s.v}" if s and s.v > 1 else ""
    style(ax, f"bubble (% of step, mean){what}", "rank")
    if layout:
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2)


def memory_bars(ax, memory: dict[str, dict[str, float]], offset: float = 0.0, width: float = 0.8,
                legend: bool = True) -> None:
    """Stacked bars, one per key of ``memory`` ({label: {category: bytes}}), in MiB."""
    labels = list(memory)
    for i, k in enumerate(labels):
        _stack(ax, offset + i, memory[k], width, legend=legend and i == 0)
    ax.set_xticks([offset + i for i in range(len(labels))], labels)


def _stack(ax, x: float, memory: dict[str, float], width: float, legend: bool = False,
           **style) -> None:
    """One bar of ``memory`` ({category: bytes}) stacked by category, in MiB."""
    bottom = 0.0
    for c in CATEGORIES:
        value = memory.get(c, 0) / MiB
        bar = ax.bar(x, value, width, bottom=bottom, color=CATEGORY_COLORS[c],
                     label=c if legend else None, **style)
        # A bar pins the axis limit at its base; stacked, that base can be the top of the
        # stack, and an empty top segment would then leave no margin above the bar.
        if bottom:
            bar.patches[0].sticky_edges.y.clear()
        bottom += value


def _cumsum(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


# --- after the fact ---------------------------------------------------------------------------
def plot(run) -> Figure:
    """The dashboard's final figure of a run (a ``Run`` or a run directory)."""
    run = as_run(run)
    metrics = {r: run.metrics(r) for r in run.dir.ranks()}
    events = run.timeline()
    fig = new_figure(figsize=(12, 9 if is_pipeline(events) else 6.2))
    draw_run(fig, metrics, events, f"{run.path.name}: {run.state}", run.config)
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
    # the step time's bar is the run's step time, the slowest rank's (analysis.steps.step_time,
    # the one every bench reports); throughput's is the median rank's
    bars = {"step_time_s": [max([row["step_time_s"] for row in s.rows if row["steps"]] or [0])
                            for s in summaries],
            "tokens_per_s": [statistics.median([row["tokens_per_s"] for row in s.rows if row["steps"]]
                                               or [0]) for s in summaries]}
    for ax, key, scale, title in ((axes[0, 0], "step_time_s", 1e3, "step time (ms, slowest rank)"),
                                  (axes[0, 1], "tokens_per_s", 1, "throughput (tokens/s, median rank)")):
        for i, s in enumerate(summaries):
            values = [row[key] * scale for row in s.rows if row["steps"]]
            ax.bar(i, bars[key][i] * scale, 0.6, color="#c9d6ea")
            ax.plot([i] * len(values), values, "o", ms=3, color="#4c72b0")
        ax.set_xticks(range(len(labels)), labels)
        style(ax, title + " - dots: ranks", "")

    ax, x = axes[1, 0], 0.0
    ticks, names, modelled = [], [], False
    for i, (run, s) in enumerate(zip(runs, summaries, strict=True)):
        mem = {f"r{row['rank']}": row["memory"] for row in s.rows if row["steps"]}
        modelled |= beside_model(ax, mem, predicted_states(run.config, [row["rank"] for row in s.rows]),
                                 offset=x, legend=i == 0)
        ticks += [x + j for j in range(len(mem))]
        names += [f"{labels[i]}\n{k}" if j == 0 else k for j, k in enumerate(mem)]
        x += len(mem) + 1
    ax.set_xticks(ticks, names, fontsize=6)
    memory_legend(ax, modelled, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=4)
    style(ax, "memory per rank by category (peak MiB)", "")

    sent_per_step_bars(axes[1, 1], runs, summaries, labels)
    return fig


def sent_per_step_bars(ax, runs, summaries, labels: list[str]) -> None:
    """Bytes sent per step, one pair of bars per rank: the ring model ``Comm`` counts (the
    summary's median) and, hatched beside it where the run has them, the bytes measured on the
    wire (median over the same steps)."""
    width = 0.8 / max(len(s.rows) for s in summaries)
    measured_any = False
    for i, (run, s) in enumerate(zip(runs, summaries, strict=True)):
        for j, row in enumerate(s.rows):
            if not row["steps"]:
                continue
            x = i - 0.4 + j * width
            wire = wire_per_step(run.metrics(row["rank"]))
            half = width / 2 if wire is not None else width
            ax.bar(x + half / 2, row["comm_sent_per_step"] / MiB, half, color="#c44e52",
                   edgecolor="white", label="model (ring)" if (i, j) == (0, 0) else None)
            if wire is not None:
                ax.bar(x + 1.5 * half, wire / MiB, half, color="#c44e52", alpha=0.5, hatch="////",
                       edgecolor="white", label=None if measured_any else "measured (wire)")
                measured_any = True
    ax.set_xticks(range(len(labels)), labels)
    style(ax, "MiB sent per step (bars per rank)", "")
    ax.legend(fontsize=6, title=None if measured_any else "wire bytes: not measured",
              title_fontsize=6)

