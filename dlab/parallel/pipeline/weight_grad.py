"""Splitting a backward into B (input gradient) and W (weight gradient), for zero-bubble schedules.

For ``y = x W^T + b`` the backward is two independent matmuls: ``dx = dy W`` (the previous stage
waits for it) and ``dW = dy^T x`` (nobody waits for it). ``_SplitLinearFn`` computes ``dx`` in the
backward and, while a ``WeightGradStore`` is deferring, leaves ``dW`` and ``db`` as closures
keyed by (stage, micro-batch); the schedule's ``weight_grad`` action runs them later (Qi et al.
2023, sec. 2; their Megatron implementation defers the same matmuls). Layer norms, embeddings
and the head's projection still get their (small) weight gradients in B.

A deferred W keeps ``x`` and ``dy`` alive until it runs: that is the extra memory zero-bubble
schedules pay, and it is counted as activations (the tensors are registered with the stage's
``ActivationMeter`` until W drops them).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from dlab.core.metrics import ActivationMeter


class WeightGradStore:
    def __init__(self, meter: ActivationMeter | None = None):
        self.meter = meter
        self.key: tuple | None = None
        self.queues: dict[tuple, list[Callable[[], None]]] = {}

    @contextmanager
    def deferring(self, key: tuple):
        """Backwards run inside leave their weight gradients under ``key``."""
        self.key = key
        self.queues.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def hold(self, t: torch.Tensor):
        """Count ``t`` as held activation memory until the returned handle is dropped."""
        return self.meter.hold(t) if self.meter is not None else t

    def put(self, fn: Callable[[], None]) -> None:
        self.queues[self.key].append(fn)

    def run(self, key: tuple) -> None:
        for fn in self.queues.pop(key):
            fn()

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        # The parameters are kept on ctx, not saved: a saved leaf comes back from unpacking as a
        # new tensor object, and W must accumulate into the parameter's own .grad.
        ctx.save_for_backward(x)
        ctx.store, ctx.weight, ctx.bias = store, weight, bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        weight, bias, store = ctx.weight, ctx.bias, ctx.store
        dx = dy @ weight

        def weight_grad(x=x, dy=dy):
            # outside autograd's engine when deferred, and x requires grad: without no_grad the
            # product would join a graph, and so would the .grad it is added into (a view of a
            # flat gradient buffer under ZeRO in ``nd``)
            with torch.no_grad():
                dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
                _accumulate(weight, dy2.t() @ x2)
                if bias is not None:
                    _accumulate(bias, dy2.sum(0))

        if store.key is None:  # not deferring: an ordinary backward
            weight_grad()
        else:
            held = (store.hold(x), store.hold(dy))
            store.put(lambda: (weight_grad(), held))
        return dx, None, None, None


def split_linears(module: nn.Module, store: WeightGradStore) -> None:
    """Route every ``nn.Linear`` in ``module`` through ``_SplitLinearFn``, whose backward can defer W."""
    for lin in module.modules():
        if isinstance(lin, nn.Linear):
            lin.forward = (lambda x, lin=lin: _SplitLinearFn.apply(x, lin.weight, lin.bias, store))
