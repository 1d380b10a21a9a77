"""``zero2``: optimizer state and gradients partitioned (ZeRO stage 2, P_os+g).

As ``zero1``, but a rank never keeps the full gradients: ``register_post_accumulate_grad_hook``
counts each unit's parameters as their gradients become final during backward; when a unit is
complete its gradients are flattened into one padded buffer, the parameters' ``.grad`` are
dropped, and the buffer's reduce-scatter is launched asynchronously, so it overlaps the
backward of the earlier units (DDP's bucket overlap, with a reduce-scatter instead of an
all-reduce). The rank keeps only its 1/N shard of each unit's averaged gradient. Before the
next unit's reduce-scatter is launched, the previous one is waited for and its flattened buffer
freed (as FSDP2 does), so at most two units' flattened gradients exist at once: gradients are
freed as they are reduced, not at the end of backward. Units complete in the same order on every
rank (the graph is the same), so the collectives match.

Bytes moved are those of stage 1 (reduce-scatter + all-gather = one all-reduce); what changes
is memory: gradients go from 2 Psi to 2 Psi / N (ZeRO paper, section 5.2).
"""
from __future__ import annotations

import torch

from dlab.parallel import register
from dlab.parallel.zero.sharded import ZeroStrategy
from dlab.parallel.zero.stage1 import gather_replicas


class GradientSharding(ZeroStrategy):
    """Reduce-scatter of each unit's gradients as soon as the unit's backward is done (shared
    by stages 2 and 3)."""

    def setup(self) -> None:
        super().setup()
        for u in self.units:
            u.grad_shard = torch.zeros(u.shard_numel, dtype=self.dtype, device=self.ctx.device)
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._start_backward()

    def _start_backward(self) -> None:
        self.waiting = {u.name: len(u.params) for u in self.units}
        self.in_flight: list = []

    def _grad_ready(self, param) -> None:
        u = self.unit_of[id(param)]
        self.waiting[u.name] -= 1
        if self.waiting[u.name] == 0:
            self.unit_backward_done(u)

    def unit_backward_done(self, u) -> None:
        self.reduce_unit(u)

    def reduce_unit(self, u) -> None:
        self._wait_in_flight()
        flat_grad = self.transient.held("reduce", u.flatten_grads())
        for p in u.params:
            p.grad = None
        self.in_flight.append((u, flat_grad, self.reduce_scatter_async(u, flat_grad)))

    def after_backward(self) -> None:
        # A unit whose parameters got no gradient this step (unused) is still reduced, in unit
        # order, so every rank issues the same collectives.
        for u in self.units:
            if self.waiting[u.name] > 0:
                self.waiting[u.name] = 0
                self.unit_backward_done(u)
        self._wait_in_flight()
        self._start_backward()

    def _wait_in_flight(self) -> None:
        for _u, flat_grad, pending in self.in_flight:
            pending.wait()
            self.transient.free(flat_grad)
        self.in_flight = []


@register("zero2")
class Zero2(GradientSharding):
    """ZeRO stage 2: optimizer state and gradients sharded, reduce-scattered during backward."""

    stage = 2

    def after_step(self) -> None:
        gather_replicas(self)
