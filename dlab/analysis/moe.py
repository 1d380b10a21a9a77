"""Reading a mixture of experts' routing from its run: the share of tokens the busiest expert
takes, the share dropped over capacity, the rows each rank's experts computed, and the
busiest rank's expert time against the mean rank's (measured, beside the rows: the model)."""
from __future__ import annotations

from statistics import median

from dlab.parallel.expert.dispatch import owner


def busiest_share(record: dict) -> float:
    layers = record["moe"]["routed"]
    return sum(max(r) / sum(r) for r in layers) / len(layers)


def dropped_share(record: dict) -> float:
    return (sum(map(sum, record["moe"]["dropped"])) / sum(map(sum, record["moe"]["routed"])))


def rank_rows(run, n: int, n_expert: int, step: int) -> list[int]:
    """Rows each rank's experts computed at ``step`` (every layer): the whole batch's kept
    assignments per expert, summed over the experts the rank owns."""
    per_expert = [0] * n_expert
    for r in range(n):
        moe = run.metrics(r)[step]["moe"]
        for routed, dropped in zip(moe["routed"], moe["dropped"]):
            for e in range(n_expert):
                per_expert[e] += routed[e] - dropped[e]
    return [sum(per_expert[e] for e in range(n_expert) if owner(e, n_expert, n) == r)
            for r in range(n)]


def experts_seconds(run, rank: int) -> dict[int, float]:
    """Per step, one rank's expert forward (its ``experts`` spans; the all-to-all waits left
    out)."""
    per_step: dict[int, float] = {}
    for e in run.timeline(rank):
        if e["kind"] == "experts":
            per_step[e["step"]] = per_step.get(e["step"], 0.0) + e["end"] - e["start"]
    return per_step


def busiest_rank(run, n: int, n_expert: int, steps: range) -> dict:
    """The busiest rank's expert time over the mean rank's (the median over ``steps``), the
    measurement, beside the same ratio of the rows each rank's experts computed, the model."""
    seconds = [experts_seconds(run, r) for r in range(n)]
    measured, tokens = [], []
    for s in steps:
        t = [seconds[r][s] for r in range(n)]
        rows = rank_rows(run, n, n_expert, s)
        measured.append(max(t) / (sum(t) / n))
        tokens.append(max(rows) / (sum(rows) / n))
    return {"dlab": median(measured), "model": median(tokens)}
