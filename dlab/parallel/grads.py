"""The gradient reduction over the data ranks: one function every strategy calls.

Each data rank's loss is the mean over its own tokens, and the data ranks hold equally many,
so the gradient of the global mean loss is the *mean* of their gradients: summed by one
all-reduce over the group, divided by the ranks whose losses it covers. The gradients go as
one flat message (one call's latency, not one per tensor; the bucketing of ``ddp`` is the same
idea overlapped with backward).

``divide_by`` is usually the group's size; it differs where a gradient arrives already summed
over part of the data ranks (an expert's, summed over its expert-parallel group by the
all-to-all's backward: reduced over dp x cp / ep ranks, divided by dp x cp) or where partial
gradients of one replica are summed, not averaged (sequence parallelism's layer norms over the
tensor-parallel group: ``divide_by=1``).

The flat message is a copy of the gradients that lives for the all-reduce: a caller that
reports its communication buffers passes its ``Transient`` (``nd``), which counts the copy
while it lives and frees it once the all-reduce is done and the result copied back.
"""
from __future__ import annotations

import torch

from dlab.comm.instrumented import Comm
from dlab.core.metrics import Transient


def reduce_gradients(params: list[torch.Tensor], comm: Comm, divide_by: int | None = None,
                     transient: Transient | None = None) -> None:
    """Sum the ``.grad`` of ``params`` over ``comm``'s ranks in one flat all-reduce, divided by
    ``divide_by`` (default: the group's size, the mean), written back into each ``.grad``; the
    flat copy counted in ``transient`` (kind ``reduce``) where one is given."""
    grads = [_grad(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if transient is not None:
        transient.held("reduce", flat)
    n = comm.size if divide_by is None else divide_by
    if n != 1:
        flat.div_(n)
    comm.all_reduce(flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
    if transient is not None:  # freed, not left to Gloo's last reference (``Transient``)
        transient.free(flat)


def _grad(p: torch.Tensor) -> torch.Tensor:
    """Where ``p``'s gradient accumulates: ``.grad``, or the fp32 ``main_grad`` beside a bf16
    parameter under ``bf16-fp32-grads`` (``dlab.parallel.mixed.MainGrads``)."""
    main = getattr(p, "main_grad", None)
    return p.grad if main is None else main
