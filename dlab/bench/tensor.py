"""``python -m dlab bench tensor``: tensor and sequence parallelism at TP = 1, 2, 4.

For each degree, with and without sequence parallelism: the step time; the bytes one rank sends
per transformer layer per step, measured (one layer's forward and backward through the counting
``Comm``, on ranks started by ``dlab.spawn``) beside ``dlab.estimate.tensor.layer_bytes``, and
the whole step's bytes from the run beside ``step_bytes``; the activation bytes each rank saves
for backward (``ActivationMeter``) beside dlab's count and beside Korthikanti et al.'s per-layer
formula (fp16, dropout, materialised softmax: a different model, shown for the shape of the
saving). Then PyTorch's ``parallelize_module`` (``torch-tp``) on the same model and batch, as
ratios dlab / PyTorch of step time and activation memory.
"""
from __future__ import annotations

import tempfile

import torch

from dlab.bench import compared, median
from dlab.estimate import tensor as est

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 8, "seq_len": 128}
QUICK_MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64}
BATCH = 8


def _layer_traffic(model_options: dict, batch: int) -> dict[bool, float]:
    """On each rank: bytes sent by one transformer layer's forward and backward (rank 0's
    figure is returned by spawn), with and without sequence parallelism."""
    from dlab import models
    from dlab.comm.instrumented import Comm
    from dlab.parallel.tensor.model import TensorParallelGPT

    comm, out = Comm(None), {}
    gpt = models.build("gpt", model_options, 0)
    idx = torch.randint(0, gpt.cfg.vocab_size, (batch, gpt.cfg.seq_len))
    for sp in (False, True):
        model = TensorParallelGPT(gpt, comm, sp)
        x = model.embed(idx).detach().requires_grad_()
        before = comm.totals().sent_bytes
        model.blocks[0](x).sum().backward()
        out[sp] = comm.totals().sent_bytes - before
    return out


def _steady(run, key: str, rank: int = 0) -> float:
    ms = run.metrics(rank)[1:] or run.metrics(rank)  # the first step pays for warm-up
    return median([m[key] for m in ms])


def _activations(run) -> int:
    return max(m["memory"]["activations"] for m in run.metrics(0))


def run(quick: bool = False) -> list[dict]:
    import dlab

    model = QUICK_MODEL if quick else MODEL
    configs = [(2, False), (2, True)] if quick else [(1, False), (2, False), (2, True),
                                                      (4, False), (4, True)]
    common = {"model": "gpt", "model_options": model, "batch_size": BATCH,
              "steps": 4 if quick else 6}
    rows, peers = [], []
    with tempfile.TemporaryDirectory() as runs_dir:
        traffic = {t: dlab.spawn(_layer_traffic, t, model, BATCH, runs_dir=runs_dir)[0]
                   for t in sorted({t for t, _ in configs if t > 1})}
        for t, sp in configs:
            options = {"tp": t, "sequence_parallel": sp}
            mine = dlab.launch("tp", t, runs_dir=runs_dir, wait=True, options=options, **common)
            peer = dlab.launch("torch-tp", t, runs_dir=runs_dir, wait=True, options=options,
                               **common)
            acts = est.activation_bytes(model, BATCH, t, sp)
            rows.append({
                "name": "tp", "tp": t, "sp": sp,
                "step_s": _steady(mine, "step_time"),
                "layer_bytes": traffic.get(t, {}).get(sp, 0.0),
                "layer_bytes_formula": est.layer_bytes(model, BATCH, t, sp),
                "step_bytes": median([m["comm"]["sent_bytes"] for m in mine.metrics(0)]),
                "step_bytes_formula": est.step_bytes(model, BATCH, t, 1, sp)["total"],
                "act_bytes": _activations(mine),
                "act_formula": acts["total"],
                "korthikanti_layers": model["n_layer"] * est.korthikanti_layer_bytes(
                    model, BATCH, t, sp),
            })
            what = {"name": "tp vs torch-tp", "tp": t, "sp": sp}
            peers.append(compared(_steady(mine, "step_time"), _steady(peer, "step_time"),
                                  metric="step_s", **what))
            peers.append(compared(_activations(mine), _activations(peer),
                                  metric="act_bytes", **what))
    return rows + peers
