"""Mixed precision's parts that every strategy with a ``precision`` option shares: the option,
the fp32 master weights, the fp32 gradient accumulation of ``bf16-fp32-grads`` and the loss
scaler's step decision.

The recipe (Micikevicius et al. 2018, "Mixed Precision Training"; the ZeRO paper's 2 + 2 + 12
bytes per parameter): the model's parameters and activations are in the compute dtype (bf16 or
fp16); the optimizer steps fp32 *master* copies, and after each step the compute copies are
refreshed from them (rounded once, so a small update is not lost to bf16's 8-bit mantissa). The
masters are the optimizer's own parameters, so the optimizer's ``state_dict`` (and a checkpoint
taken from it) holds the exact fp32 values; the model's parameters are a derived copy.

Gradients are reduced in the dtype the precision names (``Precision.grad_bytes``): ``bf16`` and
``fp16`` reduce the compute-dtype gradients; ``bf16-fp32-grads`` accumulates every
micro-batch's gradient into an fp32 buffer beside the parameter and reduces that (Megatron-LM's
``main_grad``: ``DistributedDataParallel`` with ``accumulate_allreduce_grads_in_fp32``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dlab.core.precision import PRECISIONS, LossScaler, Precision
from dlab.parallel.base import Option

PRECISION = Option("choice", "training precision: compute dtype, gradient dtype, fp32 masters "
                   "(dlab.core.precision)", default="fp32", choices=tuple(PRECISIONS))


def precision_of(config) -> Precision:
    return PRECISIONS[config.options.get("precision", "fp32")]


def grad_dtype(prec: Precision) -> torch.dtype:
    """The dtype gradients accumulate and are reduced in: fp32 where the precision keeps 4
    bytes of gradient per parameter, else the compute dtype."""
    return torch.float32 if prec.grad_bytes == 4 else prec.compute


def fp32_master(t: torch.Tensor) -> nn.Parameter:
    """An fp32 copy of ``t`` (taken before any cast to the compute dtype, so exact) for the
    optimizer to step."""
    return nn.Parameter(t.detach().to(torch.float32, copy=True))


@torch.no_grad()
def refresh(compute: torch.Tensor, master: torch.Tensor) -> None:
    """Round the updated master into the compute copy, in place (views of it stay valid)."""
    compute.copy_(master.detach())


class MainGrads:
    """fp32 accumulation for bf16 parameters: after autograd accumulates a micro-batch's bf16
    ``.grad``, a hook adds it into ``p.main_grad`` (fp32) and drops it, so the sum over
    micro-batches is taken in fp32. ``p.main_grad`` is assigned by the caller (a view of a flat
    fp32 buffer, or a tensor of its own). ``fold`` takes in what the hooks did not see (a
    zero-bubble schedule's deferred weight gradients are added to ``.grad`` outside autograd,
    so across its micro-batches they sum in bf16 before they are folded)."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        for p in params:
            p.main_grad = None
            p.register_post_accumulate_grad_hook(self._fold_one)

    @staticmethod
    def _fold_one(p: nn.Parameter) -> None:
        # .grad is None where a zero-bubble split linear deferred its weight gradient to W
        if p.main_grad is not None and p.grad is not None:
            p.main_grad.add_(p.grad)
            p.grad = None

    def fold(self) -> None:
        for p in self.params:
            if p.grad is not None:
                self._fold_one(p)


def scaled_step(scaler: LossScaler | None, master_grads: list[torch.Tensor]) -> bool:
    """With a loss scaler (fp16): unscale the fp32 master gradients, take the overflow flag's
    MAX over the whole world (every rank holds a piece of the gradients, and all must skip
    together or the replicas part), update the scale; True where the step may be applied. The
    flag travels on the raw backend, as the logged loss does: not charged to the step's bytes."""
    if scaler is None:
        return True
    found = scaler.unscale(master_grads)
    if master_grads:  # NCCL reduces on the gradients' device
        found = found.to(master_grads[0].device)
    if dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return scaler.update(found)
