"""``python -m dlab bench tensor``: tensor and sequence parallelism at TP = 1, 2, 4.

For each degree, with and without sequence parallelism (and with it, both reduce-scatters:
``reduce_scatter`` = ``backend``, Gloo's, a whole all-reduce, or ``ring``, dlab's): the step
time; the bytes one rank sends per transformer layer per step, as the *ring model* counts them
(``layer_model_bytes``: one layer's forward and backward through the counting ``Comm``, on ranks
started by ``dlab.spawn``) beside ``dlab.theory.tensor.layer_bytes``, and *measured* on the
wire in the same pass (``layer_wire_bytes``, ``dlab.comm.wire``); the whole step's bytes from
the run: ``step_model_bytes`` (ring model) beside ``step_bytes``' formula, and
``step_wire_bytes`` (measured, the strategy's collectives: the step's total less the logged
loss's mean, which goes round ``Comm``) beside ``step_gloo_bytes`` (the model of Gloo's real
algorithms applied to the step's calls); the activation bytes each rank saves for backward
(``ActivationMeter``) beside dlab's count and beside Korthikanti et al.'s per-layer formula
(fp16, dropout, materialised softmax: a different model, shown for the shape of the saving).
Then PyTorch's ``parallelize_module`` (``torch-tp``) on the same model and batch, as ratios dlab
/ PyTorch of step time and activation memory.
"""
from __future__ import annotations

import tempfile

import torch

from dlab import models
from dlab.analysis.steps import peak_memory, steady, step_time
from dlab.bench import compared, median
from dlab.comm.instrumented import Comm
from dlab.comm.wire import NOT_MEASURABLE
from dlab.parallel.tensor.model import TensorParallelGPT
from dlab.procs.launch import launch
from dlab.procs.spawn import spawn
from dlab.theory import tensor as est

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 8, "seq_len": 128}
QUICK_MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64}
BATCH = 8


def _layer_traffic(model_options: dict, batch: int) -> dict[bool, float]:
    """On each rank: bytes sent by one transformer layer's forward and backward (rank 0's
    figure is returned by spawn), with and without sequence parallelism."""

    comm, out = Comm(None), {}
    gpt = models.build("gpt", model_options, 0)
    idx = torch.randint(0, gpt.cfg.vocab_size, (batch, gpt.cfg.seq_len))
    for sp, algorithm in ((False, "backend"), (True, "backend"), (True, "ring")):
        comm.reduce_scatter_algorithm = algorithm
        model = TensorParallelGPT(gpt, comm, sp)
        x = model.embed(idx).detach().requires_grad_()
        before = comm.totals()
        model.blocks[0](x).sum().backward()
        after = comm.totals()
        wire = None if after.wire_bytes is None else after.wire_bytes - (before.wire_bytes or 0)
        out[sp, algorithm] = (after.sent_bytes - before.sent_bytes, wire)
    return out


def _steady(run, key: str, rank: int = 0) -> float:
    return median([m[key] for m in steady(run.metrics(rank))])


def _wire(run):
    """Rank 0's measured bytes per step of the strategy's own collectives (the step's total less
    what no ``Comm`` op took, the logged loss's mean), median after the first step, if
    measurable."""
    ms = steady(run.metrics(0))
    if any(m["comm"].get("wire_bytes") is None for m in ms):
        return NOT_MEASURABLE
    return median([m["comm"]["wire_bytes"] - m["comm_by_op"]["outside_comm"]["wire_bytes"] for m in ms])


def _gloo(run):
    """The model of Gloo's algorithms for rank 0's step, as ``Comm`` recorded it for its calls."""
    gloo = [m["comm"].get("gloo_bytes") for m in steady(run.metrics(0))]
    return "" if None in gloo else median(gloo)


def _activations(run) -> int:
    return peak_memory(run.metrics(0))["activations"]


def run(quick: bool = False) -> list[dict]:

    model = QUICK_MODEL if quick else MODEL
    configs = ([(2, False, "backend"), (2, True, "backend"), (2, True, "ring")] if quick else
               [(1, False, "backend"), (2, False, "backend"), (2, True, "backend"), (2, True, "ring"),
                (4, False, "backend"), (4, True, "backend"), (4, True, "ring")])
    common = {"model": "gpt", "model_options": model, "batch_size": BATCH,
              "steps": 4 if quick else 6}
    rows, peers = [], []
    with tempfile.TemporaryDirectory() as runs_dir:
        traffic = {t: spawn(_layer_traffic, t, model, BATCH, runs_dir=runs_dir)[0]
                   for t in sorted({t for t, _, _ in configs if t > 1})}
        for t, sp, algorithm in configs:
            options = {"tp": t, "sequence_parallel": sp}
            mine = launch("tp", t, runs_dir=runs_dir, wait=True,
                               options={**options, "reduce_scatter": algorithm}, **common)
            peer = launch("torch-tp", t, runs_dir=runs_dir, wait=True, options=options,
                               **common) if algorithm == "backend" else None
            layer_model, layer_wire = traffic.get(t, {}).get((sp, algorithm), (0.0, 0))
            acts = est.activation_bytes(model, BATCH, t, sp)
            rows.append({
                "name": "tp", "tp": t, "sp": sp, "reduce_scatter": algorithm,
                "step_s": step_time(mine),
                "layer_model_bytes": layer_model,
                "layer_model_bytes_formula": est.layer_bytes(model, BATCH, t, sp),
                "layer_wire_bytes": NOT_MEASURABLE if layer_wire is None else layer_wire,
                "step_model_bytes": median([m["comm"]["sent_bytes"] for m in mine.metrics(0)]),
                "step_model_bytes_formula": est.step_bytes(model, BATCH, t, 1, sp)["total"],
                "step_wire_bytes": _wire(mine),
                "step_gloo_bytes": _gloo(mine),
                "act_bytes": _activations(mine),
                "act_formula": acts["total"],
                "korthikanti_layers": model["n_layer"] * est.korthikanti_layer_bytes(
                    model, BATCH, t, sp),
            })
            if peer is None:
                continue
            what = {"name": "tp vs torch-tp", "tp": t, "sp": sp}
            peers.append(compared(step_time(mine), step_time(peer),
                                  metric="step_s", **what))
            peers.append(compared(_activations(mine), _activations(peer),
                                  metric="act_bytes", **what))
    return rows + peers
