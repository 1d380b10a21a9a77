"""``python -m dlab bench expert``: expert parallelism on the ``moe`` GPT.

For 2 and 4 ranks and top-1 / top-2 routing: the parameter bytes a rank holds beside one
process holding every expert (``single``, the peer: PyTorch has no expert-parallel module of
its own), the all-to-all bytes a rank sent per step beside what uniform routing would send
(``dlab.theory.expert``: the ratio is the router's imbalance, as this rank sees it), the
dense all-reduce bytes, and the step time beside ``single``'s.

Then MoE as trained (``dlab.models.moe``), on ``ep`` with the same seed and data: the busiest
expert's share of the routed tokens (the mean over layers, over the first and the last five
steps) with the load-balancing loss off and on, how often the busiest expert changes, the busiest
rank's measured expert time over the mean rank's (the all-to-all back waits for it) beside the
same ratio of rows computed (the model), and the share of assignments dropped at each capacity
factor. No peer: these are properties of the routing rule, the same in ``single``.
"""
from __future__ import annotations

import tempfile

from dlab.analysis.moe import busiest_rank, busiest_share, dropped_share
from dlab.analysis.steps import step_time
from dlab.bench import compared, median
from dlab.models import model_config
from dlab.procs.launch import launch
from dlab.theory import expert as est

MODEL = {"n_layer": 2, "d_model": 128, "n_head": 4, "seq_len": 128, "n_expert": 8}
QUICK_MODEL = {**MODEL, "d_model": 64, "seq_len": 64}
BATCH = 8


def _per_step(run, rank: int, op: str) -> float:
    return median([m["comm_by_op"].get(op, {}).get("sent_bytes", 0.0) for m in run.metrics(rank)])


def training_rows(runs_dir: str, quick: bool) -> list[dict]:
    """The balancing loss over steps (and the busiest rank's expert time it sets), and dropped
    tokens against the capacity factor.

    The learning rate is 1e-3 (Adam). At 3e-3 this small model's router collapses with or
    without the balancing loss: every token's hidden state is nearly the same early on, so one
    Adam step moves every token's logits together and the loss can only move the whole herd
    from expert to expert (seen while choosing the rate; the bench runs 1e-3 only)."""

    n, steps = (2, 12) if quick else (4, 40)
    model = {**(QUICK_MODEL if quick else MODEL), "top_k": 1}
    n_expert = model["n_expert"]
    common = {"model": "moe", "batch_size": BATCH, "steps": steps, "lr": 1e-3}
    rows = []
    for aux in (0.0, 0.1):
        run = launch("ep", n, runs_dir=runs_dir, wait=True,
                          model_options={**model, "aux_loss": aux}, **common)
        shares = [sum(busiest_share(run.metrics(r)[s]) for r in range(n)) / n for s in range(steps)]
        # which expert is the busiest in the first layer, step by step (over the whole batch)
        busiest = [max(range(n_expert), key=lambda e, s=s: sum(
            run.metrics(r)[s]["moe"]["routed"][0][e] for r in range(n))) for s in range(steps)]
        what = {"strategy": "ep", "ranks": n, "top_k": 1, "aux_loss": aux}
        rows.append({**what, "metric": "busiest expert share", "first_5_steps": median(shares[:5]),
                     "last_5_steps": median(shares[-5:]), "uniform": 1 / n_expert,
                     "busiest_changes": sum(a != b for a, b in zip(busiest, busiest[1:]))})
        rows.append({**what, "metric": "busiest rank's expert time / mean, last 5 steps",
                     **busiest_rank(run, n, n_expert, range(steps - 5, steps))})
    for factor in (1.0, 1.25, 2.0):
        run = launch("ep", n, runs_dir=runs_dir, wait=True,
                          model_options={**model, "capacity_factor": factor}, **{**common, "steps": 5})
        dropped = median([sum(dropped_share(run.metrics(r)[s]) for r in range(n)) / n
                          for s in range(5)])
        rows.append({"strategy": "ep", "ranks": n, "top_k": 1, "capacity_factor": factor,
                     "metric": "dropped share", "dropped": dropped})
    return rows


def run(quick: bool = False) -> list[dict]:

    rows = []
    with tempfile.TemporaryDirectory() as runs_dir:
        for k in ((1,) if quick else (1, 2)):
            model = {**(QUICK_MODEL if quick else MODEL), "top_k": k}
            mc = model_config("moe", model)
            common = {"model": "moe", "model_options": model, "batch_size": BATCH,
                      "steps": 3 if quick else 6}
            single = launch("single", 1, runs_dir=runs_dir, wait=True, **common)
            base_params = single.metrics(0)[-1]["memory"]["parameters"]
            base_s = step_time(single)
            for n in ((2,) if quick else (2, 4)):
                run = launch("ep", n, runs_dir=runs_dir, wait=True, **common)
                tokens = BATCH // n * mc.seq_len
                uniform = est.uniform_rows(tokens, k, n)
                what = {"strategy": "ep", "ranks": n, "top_k": k, "n_expert": mc.n_expert,
                        "all_to_all_MB": _per_step(run, 0, "all_to_all") / 1e6 / mc.n_layer,
                        "uniform_MB": est.all_to_all_bytes(n, mc.d_model, uniform, uniform) / 1e6,
                        "all_reduce_MB": _per_step(run, 0, "all_reduce") / 1e6}
                rows.append(compared(run.metrics(0)[-1]["memory"]["parameters"], base_params,
                                     **what, metric="parameter_bytes"))
                rows.append(compared(step_time(run), base_s,
                                     **what, metric="step_s"))
        rows += training_rows(runs_dir, quick)
    return rows
