"""The communication operators of tensor and sequence parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, sec. 3) needs only two operators, conjugate to each other:

    f   forward: identity          backward: all-reduce      (enters a tensor-parallel region)
    g   forward: all-reduce        backward: identity        (leaves it)

A column-parallel linear starts a region: its input is replicated, so its forward needs nothing,
but each rank computes only part of the input's gradient (through its columns of the weight),
so the backward must sum them: ``f``. A row-parallel linear ends a region: each rank holds a
partial sum of the output, so the forward sums them, while the output's gradient is already
whole on every rank: ``g``.

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) splits the regions *between* the
tensor-parallel ones (layer norm, dropout, residual adds) along the sequence. An all-reduce is a
reduce-scatter followed by an all-gather, and the paper cuts it in two at that seam:

    g   forward: all-gather (sequence)       backward: reduce-scatter    (replaces f)
    g_bar forward: reduce-scatter (sequence) backward: all-gather        (replaces g)

(The paper reuses the letters: its ``g`` is the all-gather that enters a region, its ``g_bar``
the reduce-scatter that leaves one. Here they are ``gather_from_sequence`` and
``scatter_to_sequence``.) The bytes on the wire are unchanged (AG + RS = AR), but every tensor
outside the tensor-parallel regions is now 1/t of its size.

Every collective goes through a counting ``Comm`` so the bytes per layer are measured, not
inferred. Activations are ``[batch, seq, hidden]``; the sequence is dimension 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dlab.comm.instrumented import Comm

# --- the tensor-parallel pair (Shoeybi et al. 2019) --------------------------------------------

class CopyToTensorParallel(torch.autograd.Function):
    """``f``: identity forward, all-reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)  # a view: the linear after it saves the same storage, not a copy

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """``g``: all-reduce forward (sums the row-parallel partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return ReduceFromTensorParallel.apply(x, comm)


# --- the sequence-parallel pair (Korthikanti et al. 2022) --------------------------------------

def all_gather_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[b, s/t, h] on each rank -> [b, s, h], rank r's slice at positions r*s/t .. (r+1)*s/t.
    The collective concatenates along dimension 0, so the sequence is moved there first."""
    local = x.transpose(0, 1).contiguous()
    out = local.new_empty((comm.size * local.shape[0], *local.shape[1:]))
    comm.all_gather_into_tensor(out, local)
    return out.transpose(0, 1)


def reduce_scatter_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[b, s, h] partial sums on each rank -> rank r's [b, s/t, h] slice of their sum."""
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((full.shape[0] // comm.size, *full.shape[1:]))
    comm.reduce_scatter_tensor(out, full)
    return out.transpose(0, 1)


class GatherFromSequenceParallel(torch.autograd.Function):
    """Korthikanti's ``g``: all-gather along the sequence forward, reduce-scatter backward (each
    rank's part of the input gradient is the sum of what every rank's columns contributed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return all_gather_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_sequence(grad, ctx.comm), None


class ScatterToSequenceParallel(torch.autograd.Function):
    """Korthikanti's ``g_bar``: reduce-scatter along the sequence forward (sum the row-parallel
    partials, keep this rank's tokens), all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return reduce_scatter_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_sequence(grad, ctx.comm), None


def gather_from_sequence_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return GatherFromSequenceParallel.apply(x, comm)


def scatter_to_sequence_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return ScatterToSequenceParallel.apply(x, comm)


def max_all_reduce(t: torch.Tensor, comm: Comm) -> None:
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
