"""``zero1``: optimizer state partitioned (ZeRO stage 1, P_os).

Every rank keeps the full parameters and full gradients, as in DDP, but runs the optimizer on
its 1/N chunk of every unit only, so the optimizer state (K bytes per parameter) is divided by
N. After backward, each unit's flat gradient is reduce-scattered (the rank receives the average
of its own chunk); the rank steps its chunk; an all-gather then brings every rank's updated
chunk into every replica. A reduce-scatter plus an all-gather move exactly what one all-reduce
moves, 2 (N-1)/N of the parameters' bytes per rank: stage 1 costs nothing extra in bandwidth
(ZeRO paper, section 7.1).

This is the plain version: the reduce-scatters wait for the end of backward (no overlap);
``zero2`` launches them from autograd hooks while backward is still running.
"""
from __future__ import annotations

import torch

from dlab.parallel import register
from dlab.parallel.zero.sharded import ZeroStrategy


@register("zero1")
class Zero1(ZeroStrategy):
    """ZeRO stage 1: Adam state sharded over ranks, gradients all-reduced (Rajbhandari et al. 2020)."""

    stage = 1

    def setup(self) -> None:
        super().setup()
        # Full gradients in one flat buffer per unit; the parameters' .grad are views of it.
        for u in self.units:
            u.flat_grad = torch.zeros(u.padded, dtype=self.dtype, device=self.ctx.device)
            u.flat_grad_views(u.flat_grad)

    def before_forward(self) -> None:
        for u in self.units:
            u.flat_grad.zero_()

    def after_backward(self) -> None:
        pending = []
        for u in self.units:
            # The reduce-scatter needs an output apart from its input; the result is copied
            # back into the rank's own chunk so the gradients stay one buffer per unit.
            u.grad_shard = self.transient.held(
                "reduce", torch.empty(u.shard_numel, dtype=self.dtype, device=self.ctx.device))
            pending.append((u, self.reduce_scatter_async(u, u.flat_grad)))
        for u, fut in pending:
            fut.wait()
            u.flat_grad[u.owned].copy_(u.grad_shard)
            self.transient.free(u.grad_shard)
            u.grad_shard = u.flat_grad[u.owned]

    def after_step(self) -> None:
        gather_replicas(self)


def gather_replicas(strategy: ZeroStrategy) -> None:
    """All-gather every unit's updated chunk into every rank's full buffer (stages 1 and 2).
    The send buffer is a copy of the chunk because the chunk is part of the receive buffer."""
    with strategy.ctx.timeline.span("param_gather"):
        pending = []
        for u in strategy.units:
            send = strategy.transient.held("send", u.shard.clone())
            pending.append((u, send, strategy.gather_async(u, send)))
        for _u, send, fut in pending:
            fut.wait()
            strategy.transient.free(send)
