"""``python -m dlab bench context``: context parallelism on a long sequence.

For ring and all-gather attention, zigzag and contiguous layouts, and Ulysses, at 2 and 4
ranks, and USP (Ulysses in pairs, the ring across them) at 4: the peak activation bytes a rank
saves for backward, the bytes it sends per step beside
``dlab.theory.context``, and the median step time. The peer is ``single``, one process with
the whole sequence: the ratio of activations is what context parallelism is for (ring: about
1/n of it; all-gather: more, since every rank keeps the whole sequence's K and V). PyTorch's
own ``context_parallel`` is not the peer: on CPU it has no causal ring (see TORCH_ON_CPU).
The ``work_ratio`` column is the busiest rank's causal (query, key) pairs over the average
rank's (``layout.visible_pairs``): 1 for zigzag, (2n-1)/n for contiguous. For the ring, one more
row per layout sets the *measured* busiest rank's attention time (its tiles' compute, the
``attention_tiles`` spans, waits excluded; median over steps) over the mean rank's beside the
same ratio of the score pairs each rank computes (``attention.computed_pairs``: the hidden
tiles skipped, diagonal tiles whole), the model.
"""
from __future__ import annotations

import tempfile

from dlab.analysis.steps import peak_memory, step_time
from dlab.bench import compared, median
from dlab.layout import tokens as layout
from dlab.models import model_config
from dlab.parallel.context.attention import computed_pairs
from dlab.procs.launch import launch
from dlab.theory import context as est

MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 1024}
QUICK_MODEL = {**MODEL, "seq_len": 256}
BATCH = 2


def _peak_activations(run, ranks: int) -> int:
    return max(peak_memory(run.metrics(r))["activations"] for r in range(ranks))


def _attention_seconds(run, rank: int) -> float:
    """The median over steps (the first left out) of one rank's ring-attention compute."""
    per_step: dict[int, float] = {}
    for e in run.timeline(rank):
        if e["kind"] == "attention_tiles":
            per_step[e["step"]] = per_step.get(e["step"], 0.0) + e["end"] - e["start"]
    return median([t for step, t in sorted(per_step.items()) if step > 0])


def _imbalance(run, lay: str, seq_len: int, n: int, what: dict) -> dict:
    seconds = [_attention_seconds(run, r) for r in range(n)]
    positions = [layout.positions(lay, seq_len, r, n) for r in range(n)]
    pairs = [computed_pairs(positions, r) for r in range(n)]
    return {**what, "metric": "attention busiest/mean", "dlab": max(seconds) / (sum(seconds) / n),
            "model": max(pairs) / (sum(pairs) / n),
            "attention_ms_per_rank": [round(1e3 * t, 2) for t in seconds]}


def run(quick: bool = False) -> list[dict]:

    model = QUICK_MODEL if quick else MODEL
    common = {"model": "gpt", "model_options": model, "batch_size": BATCH, "steps": 3 if quick else 5}
    cfg = model_config("gpt", model)
    configs = [("ring", "zigzag", 2), ("allgather", "zigzag", 2)] if quick else [
        (a, lay, n) for n in (2, 4) for a, lay in
        (("ring", "zigzag"), ("ring", "contiguous"), ("allgather", "zigzag"), ("ulysses", "zigzag"))
    ] + [("usp", "zigzag", 4)]
    rows = []
    with tempfile.TemporaryDirectory() as runs_dir:
        single = launch("single", 1, runs_dir=runs_dir, wait=True, **common)
        base_act, base_s = _peak_activations(single, 1), step_time(single)
        for attention, lay, n in configs:
            run = launch("cp", n, runs_dir=runs_dir, wait=True,
                              options={"attention": attention, "layout": lay}, **common)
            work = [layout.visible_pairs(lay, cfg.seq_len, r, n) for r in range(n)]
            kv = est.kv_bytes(BATCH, cfg.seq_len, cfg.d_model, n)
            what = {"strategy": "cp", "attention": attention, "layout": lay, "ranks": n,
                    "seq_len": cfg.seq_len,
                    "sent_MB": median([m["comm"]["sent_bytes"] for m in run.metrics(0)]) / 1e6,
                    "sent_formula_MB": est.sent_per_step(attention, n, cfg.n_layer, kv,
                                                         4 * cfg.n_params(), ulysses=2) / 1e6,
                    "work_ratio": round(max(work) / (sum(work) / n), 3)}
            rows.append(compared(_peak_activations(run, n), base_act, **what,
                                 metric="activation_bytes"))
            rows.append(compared(step_time(run), base_s, **what, metric="step_s"))
            if attention == "ring":
                rows.append(_imbalance(run, lay, cfg.seq_len, n, what))
    return rows
