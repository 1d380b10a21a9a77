"""A planned layout run small: the capstone's (notebook 14) proxy and its audit.

A layout chosen for thousands of GPUs cannot run here, but its *kinds* of parallelism can: the
proxy keeps each dimension the plan uses at degree 2, as many as ``ranks`` allows, the
model-splitting ones first (tp, cp, pp: their collectives are what the plan's bytes and
activations depend on; data parallelism adds only its gradient reduction), with the plan's
ZeRO stage and sequence parallelism. It runs a small GPT in fp32 with SGD, beside ``single``.

The audit holds the proxy to two things, on every rank:

- parity: the losses step by step and the final parameters equal ``single``'s to ``tol``
  (fp32: the ranks sum the same numbers in another order), and every rank's final parameters
  equal rank 0's bit for bit;
- the estimates (``dlab.theory.nd``, written apart from the strategy): model state to the byte,
  bytes sent per step by dimension, and the activation peak to 2 % (the meter counts an index
  tensor by its whole storage: a micro-batch's slice keeps the rank's batch).
"""
from __future__ import annotations

import torch

from dlab.core.config import RunConfig
from dlab.layout import Layout, ranks
from dlab.theory import nd

#: the dimensions a proxy keeps, in the order it keeps them
ORDER = ("tp", "cp", "pp", "dp")
STATE = ("parameters", "gradients", "optimizer")


def proxy_options(layout, ranks_: int = 4) -> dict:
    """``nd`` options for a proxy of ``layout`` (a ``PlanLayout``) on ``ranks_`` ranks: each
    dimension it uses at degree 2 while the product stays within ``ranks_`` (``ORDER``), data
    parallelism filling what is left; its ZeRO stage where the proxy has data ranks, sequence
    parallelism where it keeps tp, its pipeline schedule where it keeps pp (one chunk per
    stage: the proxy GPT has few layers)."""
    if ranks_ < 2 or ranks_ & (ranks_ - 1):
        raise ValueError(f"a proxy needs a power of two ranks, at least 2 (got {ranks_})")
    degrees, used = {}, 1
    for dim in ORDER:
        if getattr(layout, dim) > 1 and used * 2 <= ranks_:
            degrees[dim] = 2
            used *= 2
    if used < ranks_:
        degrees["dp"] = degrees.get("dp", 1) * ranks_ // used
    out = dict(degrees)
    if layout.zero and degrees.get("dp", 1) * degrees.get("cp", 1) > 1:
        out["zero"] = layout.zero
    if layout.sequence_parallel and "tp" in degrees:
        out["sequence_parallel"] = True
    if "pp" in degrees:
        out["schedule"] = layout.schedule if layout.schedule in ("1f1b", "gpipe") else "1f1b"
    return out


def _final(run, rank: int) -> dict[str, torch.Tensor]:
    name = "final_state.pt" if rank == 0 else f"final_state_rank{rank}.pt"
    return torch.load(run.path / name, weights_only=True)


def parity(run, reference, tol: float = 1e-5) -> list[dict]:
    """Per rank: the largest loss and final-parameter differences from ``reference`` (a
    ``single`` run of the same config, ``save_final=True`` on both), whether they are within
    ``tol``, and whether the rank's parameters equal rank 0's bit for bit."""
    want_losses = [m["loss"] for m in reference.metrics(0)]
    want = _final(reference, 0)
    first = _final(run, 0)
    rows = []
    for r in range(run.world_size):
        losses = [m["loss"] for m in run.metrics(r)]
        mine = _final(run, r)
        loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses)) if losses else float("inf")
        param_diff = max((mine[k] - want[k]).abs().max().item() for k in want)
        rows.append({"rank": r, "loss_diff": loss_diff, "param_diff": param_diff,
                     "same_as_rank0": all(torch.equal(mine[k], first[k]) for k in first),
                     "ok": len(losses) == len(want_losses) and max(loss_diff, param_diff) <= tol})
    return rows


def against_estimate(run) -> list[dict]:
    """Per rank, the last step's measured model state, bytes sent by dimension and activation
    peak beside ``dlab.theory.nd``'s, and whether each agrees (state to the byte, bytes to
    1e-9 relative, activations to 2 %)."""
    cfg = RunConfig.from_dict(run.config)
    lay, mc = Layout.from_options(cfg.options, cfg.world_size), cfg.model_config()
    rows = []
    for r in range(run.world_size):
        pp_rank = ranks.coords(lay.dims, r)["pp"]
        m = run.metrics(r)[-1]
        state = nd.model_state(mc, lay, pp_rank, cfg.optimizer)
        sent = nd.step_bytes(mc, lay, cfg.batch_size, pp_rank)
        held = nd.activations(mc, lay, cfg.batch_size, pp_rank)["peak"]
        got_state = sum(m["memory"][k] for k in STATE)
        got_sent = {d: v["sent_bytes"] for d, v in m["comm_by_dim"].items()}
        rows.append({
            "rank": r, "state": got_state, "state_model": sum(state.values()),
            "sent": m["comm"]["sent_bytes"], "sent_model": sent["total"],
            "activations": m["memory"]["activations"], "activations_model": held,
            "state_ok": all(m["memory"][k] == state[k] for k in STATE),
            "sent_ok": all(abs(v - sent[d]) <= 1e-9 * max(sent[d], 1.0) for d, v in got_sent.items())
            and abs(m["comm"]["sent_bytes"] - sent["total"]) <= 1e-9 * max(sent["total"], 1.0),
            "activations_ok": abs(m["memory"]["activations"] / held - 1) <= 0.02})
    return rows
