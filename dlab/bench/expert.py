"""``python -m dlab bench expert``: expert parallelism on the ``moe`` GPT.

For 2 and 4 ranks and top-1 / top-2 routing: the parameter bytes a rank holds beside one
process holding every expert (``single``, the peer: PyTorch has no expert-parallel module of
its own), the all-to-all bytes a rank sent per step beside what uniform routing would send
(``dlab.estimate.expert``: the ratio is the router's imbalance, as this rank sees it), the
dense all-reduce bytes, and the step time beside ``single``'s.
"""
from __future__ import annotations

import tempfile

from dlab.bench import compared, median
from dlab.estimate import expert as est
from dlab.models import model_config

MODEL = {"n_layer": 2, "d_model": 128, "n_head": 4, "seq_len": 128, "n_expert": 8}
QUICK_MODEL = {**MODEL, "d_model": 64, "seq_len": 64}
BATCH = 8


def _per_step(run, rank: int, op: str) -> float:
    return median([m["comm_by_op"].get(op, {}).get("sent_bytes", 0.0) for m in run.metrics(rank)])


def run(quick: bool = False) -> list[dict]:
    import dlab

    rows = []
    with tempfile.TemporaryDirectory() as runs_dir:
        for k in ((1,) if quick else (1, 2)):
            model = {**(QUICK_MODEL if quick else MODEL), "top_k": k}
            mc = model_config("moe", model)
            common = {"model": "moe", "model_options": model, "batch_size": BATCH,
                      "steps": 3 if quick else 6}
            single = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, **common)
            base_params = single.metrics(0)[-1]["memory"]["parameters"]
            base_s = median([m["step_time"] for m in single.metrics(0)[1:]])
            for n in ((2,) if quick else (2, 4)):
                run = dlab.launch("ep", n, runs_dir=runs_dir, wait=True, **common)
                tokens = BATCH // n * mc.seq_len
                uniform = est.uniform_rows(tokens, k, n)
                what = {"strategy": "ep", "ranks": n, "top_k": k, "n_expert": mc.n_expert,
                        "all_to_all_MB": _per_step(run, 0, "all_to_all") / 1e6 / mc.n_layer,
                        "uniform_MB": est.all_to_all_bytes(n, mc.d_model, uniform, uniform) / 1e6,
                        "all_reduce_MB": _per_step(run, 0, "all_reduce") / 1e6}
                rows.append(compared(run.metrics(0)[-1]["memory"]["parameters"], base_params,
                                     **what, metric="parameter_bytes"))
                rows.append(compared(median([m["step_time"] for m in run.metrics(0)[1:]]), base_s,
                                     **what, metric="step_s"))
    return rows
