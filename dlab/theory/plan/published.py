"""Published at-scale results, each beside the planner's prediction of the same configuration,
scored leave-one-source-out.

Every row (``dlab.theory.plan.rows``) is a configuration a paper or a project's benchmark page
trained and measured, with the figure as the source states it, the FLOPs convention it used,
the software stack it ran (``dlab.theory.plan.stacks``) and what was assumed where the source
is silent. A predicted step time T converts into the source's own metric:

- ``tflops_per_gpu``: the source's FLOPs per step / T / N (conventions below); ``mfu`` that
  over the peak the source divided by;
- ``iteration_s``: T itself; ``tokens_per_s_per_gpu``: B s / T / N.

Conventions: ``megatron``, Narayanan et al. 2021, eq. 3, 96 B s l h^2 (1 + s / 6h + V / 16 l h)
per iteration, which counts full activation recomputation (4 passes, not 3); ``model``, 6 per
parameter a token multiplies by plus 12 L h s (``Transformer.flops_per_token``: the head
counted, the input embedding not), which is also Megatron-Core's own count (its
``num_floating_point_operations``); ``6N``, 6 per parameter of the whole model (input embedding
included) plus 12 L h s, torchtitan's count in 2024.

Blind first. A source is scored the moment it is added, with the planner as it stands, before
any constant or modelling choice is made with it in view, and that score is recorded once with
the commit it was scored at (``blind.json`` beside ``rows/``; ``record_blind`` refuses to
write a source twice). ``blind_table`` prints each source's blind score beside its current
one: the blind one is the honest figure for a source the planner was then changed with. The
six sources the planner was built on have no blind score; their first recorded one is marked
so.

Honesty. Every constant of the clusters and stacks is a hardware or documentation figure, set
apart from these rows (``dlab.theory.plan.cluster``). One planner-wide constant is chosen by
looking at rows: ``SUSTAINED``, the share of a kernel's benchmarked rate it keeps inside a
training step (``dlab.theory.plan.predict``). It is chosen by ``fit`` (the value that minimises
the mean absolute throughput error), and each source is scored with it fitted on the *other*
sources only (``leave_one_source_out``): no constant is chosen while looking at the rows it is
scored on. ``check`` gives each row's low and high from the spread of the constants
(``dlab.theory.plan.ranges``), the sustained share's spread being how far each source's own
fit lies from the common one (``spread``), widened to the predictions of what the source
leaves open (``Published.alternatives``).
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from dlab.theory.plan.predict import SUSTAINED
from dlab.theory.plan.ranges import KNOBS, step_range
from dlab.theory.plan.rows import ROWS, Published, Source
from dlab.theory.plan.time import Knobs

__all__ = ["ROWS", "Published", "Source", "blind_scores", "blind_table", "by_source", "check", "fit",
           "leave_one_source_out", "mean_abs_error", "record_blind", "signed_mean_error",
           "source_fits", "spread", "table", "with_stack"]

BLIND = Path(__file__).with_name("blind.json")
BLIND_FORMAT = "dlab-plan-blind/1"


def _rows():
    return ROWS


def steps(rows, sustained_values) -> dict:
    """Each row's predicted step at each sustained share: {row index: [step at each value]}."""
    return {i: [row.plan(Knobs(sustained=s)).step_s for s in sustained_values]
            for i, row in enumerate(rows)}


GRID = tuple(round(0.55 + 0.05 * k, 2) for k in range(11))  # 0.55 .. 1.05


def _interp(grid, values, x) -> float:
    """Step time at ``x``, linear in 1 / sustained between grid points (compute scales so)."""
    inv = [1 / g for g in grid]
    xi = 1 / x
    for k in range(len(grid) - 1):
        if inv[k + 1] <= xi <= inv[k]:
            w = (xi - inv[k + 1]) / (inv[k] - inv[k + 1])
            return values[k + 1] + w * (values[k] - values[k + 1])
    return values[0] if xi > inv[0] else values[-1]


def _fit_one(rows, table, indices) -> float:
    def loss(x):
        return statistics.fmean(abs(rows[i].throughput_error(_interp(GRID, table[i], x)))
                                for i in indices)
    lo, hi = GRID[0], GRID[-1]
    for _ in range(40):  # golden-section search
        a, b = hi - (hi - lo) / 1.618, lo + (hi - lo) / 1.618
        if loss(a) < loss(b):
            hi = b
        else:
            lo = a
    return round((lo + hi) / 2, 3)


def fit(rows=None, table: dict | None = None, indices=None) -> dict[str, float]:
    """Per GPU die, the sustained share that minimises the mean absolute throughput error over
    ``rows`` of that die (or the rows at ``indices``; ``table``: each row's steps on ``GRID``)."""
    rows = list(rows if rows is not None else _rows())
    table = table if table is not None else steps(rows, GRID)
    indices = list(indices if indices is not None else range(len(rows)))
    gens = dict.fromkeys(rows[i].generation for i in indices)
    return {gen: _fit_one(rows, table, [i for i in indices if rows[i].generation == gen])
            for gen in gens}


def leave_one_source_out(rows=None) -> dict[str, dict[str, float]]:
    """For each source, the sustained shares fitted on every *other* source's rows."""
    rows = list(rows if rows is not None else _rows())
    table = steps(rows, GRID)
    keys = dict.fromkeys(r.source.key for r in rows)
    return {key: fit(rows, table, [i for i, r in enumerate(rows) if r.source.key != key])
            for key in keys}


def source_fits(rows=None, table: dict | None = None) -> dict[str, dict[str, float]]:
    """For each source, the sustained shares its own rows alone would choose."""
    rows = list(rows if rows is not None else _rows())
    table = table if table is not None else steps(rows, GRID)
    keys = dict.fromkeys(r.source.key for r in rows)
    return {key: fit(rows, table, [i for i, r in enumerate(rows) if r.source.key == key])
            for key in keys}


def spread(rows=None, table: dict | None = None) -> tuple[float, float]:
    """How far the sustained share moves from source to source: the largest distance of a
    source's own fit from the all-source fit of its GPU die, as a ratio, taken either way (an
    unseen stack may sit on either side) (``SUSTAINED_SPREAD``)."""
    rows = list(rows if rows is not None else _rows())
    table = table if table is not None else steps(rows, GRID)
    full = fit(rows, table)
    far = max(abs(v / full[gen] - 1) for fits in source_fits(rows, table).values()
              for gen, v in fits.items())
    return round(1 - far, 2), round(1 + far, 2)


def check(rows=None, loso: dict | None = None, ranges: bool = True) -> list[dict]:
    """Each row's published figure beside the prediction with the sustained share fitted
    without its source (``loso``; ``leave_one_source_out`` when not given), and its range:
    ``error`` in the source's metric, ``throughput_error`` in throughput (an iteration time's
    inverse), positive where the planner is optimistic; ``low`` and ``high`` the metric's range
    (the constants' spread, widened to the predictions of the source's open alternatives) and
    ``inside`` whether the published figure lies in it."""
    rows = list(rows if rows is not None else _rows())
    loso = loso if loso is not None else leave_one_source_out(rows)
    out = []
    for row in rows:
        sustained = loso.get(row.source.key, {}).get(row.generation, SUSTAINED.get(row.generation, 1.0))
        knobs = Knobs(sustained=sustained)
        p = row.plan(knobs)
        pred = row.predicted(p.step_s)
        entry = {"source": row.source.short, "key": row.source.key, "model": row.model.name,
                 "gpus": row.gpus, "batch": row.global_batch, "layout": row.layout.describe(),
                 "stack": row.stack,
                 "metric": row.metric, "published": row.value, "predicted": pred,
                 "error": pred / row.value - 1, "throughput_error": row.throughput_error(p.step_s),
                 "sustained": sustained, "generation": row.generation, "fits": p.fits,
                 "memory_GB": p.memory["total"] / 1e9,
                 "assumed": row.assumed}
        if ranges:
            fast, slow = step_range(p, KNOBS)
            metric = [row.predicted(fast), row.predicted(slow)]
            for change in row.alternatives:
                other = replace(row.layout, **change)
                if not other.problems(row.model, row.global_batch, row.seq_len):
                    metric.append(row.predicted(row.plan(knobs, other).step_s))
            entry.update(low=min(metric), high=max(metric),
                         inside=min(metric) <= row.value <= max(metric))
        out.append(entry)
    return out


def mean_abs_error(results: list[dict]) -> float:
    """Mean absolute throughput error over the rows."""
    return statistics.fmean(abs(r["throughput_error"]) for r in results)


def signed_mean_error(results: list[dict]) -> float:
    """Mean signed throughput error: positive where the planner is optimistic on average."""
    return statistics.fmean(r["throughput_error"] for r in results)


def by_source(results: list[dict]) -> dict[str, dict]:
    """Per source: rows, mean absolute and signed throughput error, share inside the range, and
    the sustained shares it was scored with (fitted without it), by GPU die."""
    out = {}
    for key in dict.fromkeys(r["key"] for r in results):
        mine = [r for r in results if r["key"] == key]
        out[key] = {"source": mine[0]["source"], "rows": len(mine),
                    "mean_abs": mean_abs_error(mine), "signed": signed_mean_error(mine),
                    "inside": (statistics.fmean(r["inside"] for r in mine) if "inside" in mine[0]
                               else math.nan),
                    "sustained": {r["generation"]: r["sustained"] for r in mine}}
    return out


def table(results: list[dict], sources: list | None = None) -> str:
    """``check``'s rows as text: each configuration, the source's figure, the plan's with its
    range and the error in throughput; then per source and overall."""
    lines = [f"{'model':15s} {'GPUs':>5s} {'layout':40s} {'stack':24s} {'metric':>14s} "
             f"{'paper':>8s} {'plan':>8s} {'range':>17s} {'error':>6s}"]
    for r in results:
        rng = f"{r['low']:8.3g}-{r['high']:<8.3g}" if "low" in r else ""
        mark = "" if r.get("inside", True) else " *"
        lines.append(f"{r['model'][:15]:15s} {r['gpus']:5d} {r['layout'][:40]:40s} {r['stack'][:24]:24s} "
                     f"{r['metric']:>14s} {r['published']:8.4g} {r['predicted']:8.4g} {rng:>17s} "
                     f"{r['throughput_error']:+6.1%}{mark}")
    lines.append("per source (each scored with the sustained shares fitted on the other sources):")
    for s in by_source(results).values():
        inside = f", {s['inside']:.0%} inside their ranges" if not math.isnan(s["inside"]) else ""
        lines.append(f"  {s['source']:34s} {s['rows']:3d} rows: mean absolute error {s['mean_abs']:5.1%}, "
                     f"signed {s['signed']:+5.1%}{inside}")
    inside = (f", {statistics.fmean(r['inside'] for r in results):.0%} inside their ranges"
              if "inside" in results[0] else "")
    lines.append(f"all: mean absolute error {mean_abs_error(results):.1%}, signed "
                 f"{signed_mean_error(results):+.1%}{inside}, over {len(results)} configurations "
                 f"from {len(by_source(results))} sources (* outside its range)")
    for source in dict.fromkeys(r.source for r in (sources or _rows())):
        lines.append(f" - {source.short}: {source.cite}")
    return "\n".join(lines)


def with_stack(rows, stack: str) -> list:
    """The rows as if run under ``stack`` (notebook 11's exercise on a stack's assumptions)."""
    return [replace(r, stack=stack) for r in rows]


def blind_scores(path: Path = BLIND) -> dict[str, dict]:
    """Each source's first score (module docstring): {key: {"commit", "rows", "mean_abs",
    "signed", "inside", "blind", "note"}}."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != BLIND_FORMAT:
        raise ValueError(f"{path} is not a blind-score record ({BLIND_FORMAT})")
    return doc["sources"]


def record_blind(results: list[dict], keys, commit: str, blind: bool = True, note: str = "",
                 path: Path = BLIND) -> dict[str, dict]:
    """Write the sources ``keys``' scores in ``results`` (``check``'s, made at ``commit``) as
    their first scores; a source already recorded is refused (a blind score is written once)."""
    doc = json.loads(Path(path).read_text()) if Path(path).exists() else {
        "format": BLIND_FORMAT, "sources": {}}
    scores = by_source(results)
    keys = list(keys)
    again = [k for k in keys if k in doc["sources"]]
    missing = [k for k in keys if k not in scores]
    if again or missing:
        raise ValueError(f"cannot record {', '.join(again + missing)}: "
                         + ("already recorded (a blind score is written once)" if again else
                            "no such source among the rows"))
    for key in keys:
        s = scores[key]
        doc["sources"][key] = {"commit": commit, "rows": s["rows"], "mean_abs": round(s["mean_abs"], 4),
                               "signed": round(s["signed"], 4), "inside": round(s["inside"], 4),
                               "blind": blind, "note": note}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return doc["sources"]


def blind_table(results: list[dict], blind: dict | None = None) -> str:
    """Per source, its first (blind) score with its commit beside its current score; then the
    rows of sources scored blind, over both."""
    blind = blind_scores() if blind is None else blind
    now = by_source(results)
    lines = [f"{'source':34s} {'rows':>4s}  {'blind: MAE  signed inside  commit':34s}  "
             f"{'now: MAE  signed inside':24s}"]
    for key, s in now.items():
        b = blind.get(key)
        first = (f"{b['mean_abs']:9.1%} {b['signed']:+7.1%} {b['inside']:6.0%}  {b['commit'][:7]}"
                 + ("" if b["blind"] else " (built on)") if b else "  (no blind score)")
        lines.append(f"{s['source'][:34]:34s} {s['rows']:4d}  {first:34s}  {s['mean_abs']:8.1%} "
                     f"{s['signed']:+7.1%} {s['inside']:6.0%}")
    scored = [r for r in results if blind.get(r["key"], {}).get("blind")]
    if scored:
        weights = {k: b["rows"] for k, b in blind.items() if b["blind"] and k in now}
        rows = sum(weights.values())
        first = sum(blind[k]["mean_abs"] * n for k, n in weights.items()) / rows
        signed = sum(blind[k]["signed"] * n for k, n in weights.items()) / rows
        lines.append(f"sources scored blind ({len(weights)}, {rows} rows): blind mean absolute error "
                     f"{first:.1%}, signed {signed:+.1%}; now {mean_abs_error(scored):.1%}, signed "
                     f"{signed_mean_error(scored):+.1%}")
    return "\n".join(lines)
