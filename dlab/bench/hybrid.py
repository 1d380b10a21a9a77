"""``python -m dlab bench hybrid``: one GPT on 4 ranks, laid out every way dp x pp x tp allows.

Layouts: data parallel (``ddp``, 4 x 1 x 1), tensor parallel (``tp``, 1 x 1 x 4), TP x DP
(2 x 1 x 2), pipeline (``pipeline-1f1b``, 1 x 4 x 1, 4 micro-batches), PP x DP (2 x 2 x 1) and
PP x TP (1 x 2 x 2). Per layout: the parameters the fullest rank holds and the bytes the
busiest rank sends per step, each beside ``dlab.theory.nd`` (which covers all six: p = 1
is TP x DP, t = 1 and p = 1 is plain data parallelism), the activation peak, and the step time
beside PyTorch's DDP on the same ranks (the peer: the layout a beginner starts from), both
timed alike (``dlab.analysis.steps.step_time``: the slowest rank's median step).

What to read in it: every layout but DP cuts the parameters per rank; TP pays with per-layer
all-reduces of activations, the pipeline with a bubble and little traffic; on 2 CPU cores
with 4 ranks the time column shows the costs, not speed-ups (there is no spare compute).
"""
from __future__ import annotations

import tempfile

from dlab.analysis.steps import step_time
from dlab.bench import compared
from dlab.layout import Layout
from dlab.models import model_config
from dlab.procs.launch import launch
from dlab.theory import nd

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 128}
BATCH, WORLD = 8, 4
# (label, strategy, options, (dp, pp, tp))
LAYOUTS = [("DP", "ddp", {}, (4, 1, 1)),
           ("TP", "tp", {"tp": 4}, (1, 1, 4)),
           ("TP x DP", "tp", {"tp": 2}, (2, 1, 2)),
           ("PP", "pipeline-1f1b", {}, (1, 4, 1)),
           ("PP x DP", "pipeline-1f1b", {"dp": 2}, (2, 2, 1)),
           ("PP x TP", "pipeline-1f1b", {"tp": 2}, (1, 2, 2))]


def formulas(dp: int, pp: int, tp: int) -> list[tuple[int, float]]:
    """(parameters, bytes sent per step) of every rank's stage (``dlab.theory.nd``; a rank's
    stage is its pp coordinate, which only the maxima compared below need)."""
    cfg, lay = model_config("gpt", MODEL), Layout(dp=dp, pp=pp, tp=tp)
    return [(nd.model_state(cfg, lay, s)["parameters"] // 4, nd.step_bytes(cfg, lay, BATCH, s)["total"])
            for s in range(pp)]


def run(quick: bool = False) -> list[dict]:

    layouts = LAYOUTS[:1] + LAYOUTS[-1:] if quick else LAYOUTS
    common = {"model_options": MODEL, "batch_size": BATCH, "steps": 3 if quick else 6}
    rows = []
    with tempfile.TemporaryDirectory() as runs_dir:
        peer = launch("torch-ddp", WORLD, runs_dir=runs_dir, wait=True, **common)
        peer_s = step_time(peer)
        for label, strategy, options, (dp, pp, tp) in layouts:
            run = launch(strategy, WORLD, runs_dir=runs_dir, wait=True, options=options,
                              **common)
            last = [run.metrics(r)[-1] for r in range(WORLD)]
            want = formulas(dp, pp, tp)
            rows.append(compared(
                step_time(run), peer_s, layout=label, strategy=strategy, dp=dp, pp=pp, tp=tp,
                ranks=WORLD, metric="step_s",
                params_MB=max(m["memory"]["parameters"] for m in last) / 1e6,
                params_formula_MB=max(4 * p for p, _ in want) / 1e6,
                sent_MB=max(m["comm"]["sent_bytes"] for m in last) / 1e6,
                sent_formula_MB=max(s for _, s in want) / 1e6,
                activations_MB=max(m["memory"]["activations"] for m in last) / 1e6))
    return rows
