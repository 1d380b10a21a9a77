"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019) with optional sequence parallelism
(Korthikanti et al. 2022).

For ``Y = X A^T + b`` with ``A`` of shape [out, in] (``nn.Linear``'s layout):

- column-parallel: rank r holds rows r of ``A`` (output features) and of ``b``; every rank sees
  the whole ``X`` and produces its slice of ``Y``'s features. Nothing to sum forward; the input's
  gradient is a sum over ranks (``f``).
- row-parallel: rank r holds columns r of ``A`` (input features) and consumes its slice of ``X``
  (exactly what a column-parallel layer before it produced); the outputs are partial sums (``g``)
  and the bias, held whole, is added once, after the sum.

Column then row is the pattern of both the MLP (fc, proj) and attention (q/k/v split by heads,
then proj): one all-reduce forward and one backward per sub-layer, with the nonlinearity (GeLU,
softmax within a head) applied locally in between.

With sequence parallelism the input of a column-parallel group is sequence-sharded. Gathering it
with ``gather_from_sequence_parallel`` and then calling ``F.linear`` would keep the *gathered*
input for the weight gradient, losing the memory saving; ``SequenceParallelColumn`` keeps only
the local shard and gathers again in backward (Korthikanti et al. sec. 4.2.2: one extra
all-gather, which Megatron overlaps with the input-gradient matmul).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlab.comm.instrumented import Comm
from dlab.parallel.tensor.ops import (
    all_gather_sequence,
    copy_to_tensor_parallel,
    max_all_reduce,
    reduce_from_tensor_parallel,
    reduce_scatter_sequence,
    scatter_to_sequence_parallel,
)


def shard_rows(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return w.detach().chunk(size, dim=0)[rank].clone()


def shard_cols(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return w.detach().chunk(size, dim=1)[rank].clone()


class SequenceParallelColumn(torch.autograd.Function):
    """Sequence-parallel entry into a group of column-parallel linears sharing one input
    (q, k and v): one all-gather forward for all of them, one all-gather (to rebuild the input
    for the weight gradients) and one reduce-scatter (of the summed input gradient) backward.
    Saves only this rank's sequence shard of the input."""

    @staticmethod
    def forward(ctx, x_local, comm: Comm, *params):
        ctx.comm = comm
        ctx.save_for_backward(x_local, *params)
        x = all_gather_sequence(x_local, comm)
        pairs = zip(params[0::2], params[1::2], strict=True)
        return tuple(F.linear(x, w, b) for w, b in pairs)

    @staticmethod
    def backward(ctx, *grads):
        x_local, *params = ctx.saved_tensors
        x = all_gather_sequence(x_local, ctx.comm).reshape(-1, x_local.shape[-1])
        grad_x, out = None, []
        for g, w, b in zip(grads, params[0::2], params[1::2], strict=True):
            g2 = g.reshape(-1, g.shape[-1])
            gx = g2 @ w
            grad_x = gx if grad_x is None else grad_x + gx
            out += [g2.t() @ x, None if b is None else g2.sum(0)]
        b, s = x_local.shape[0], x_local.shape[1] * ctx.comm.size
        grad_x_local = reduce_scatter_sequence(grad_x.view(b, s, -1), ctx.comm)
        return (grad_x_local, None, *out)


def column_parallel(x: torch.Tensor, layers: list[ColumnParallelLinear], comm: Comm,
                    sequence_parallel: bool) -> list[torch.Tensor]:
    """Apply column-parallel ``layers`` that share the input ``x`` (entering the region once)."""
    if sequence_parallel:
        params = [p for layer in layers for p in (layer.weight, layer.bias)]
        return list(SequenceParallelColumn.apply(x, comm, *params))
    x = copy_to_tensor_parallel(x, comm)
    return [F.linear(x, layer.weight, layer.bias) for layer in layers]


class ColumnParallelLinear(nn.Module):
    """Rank ``rank``'s rows of a linear layer (its slice of the output features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                 sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, sequence_parallel: bool = False):
        r, t = comm.rank, comm.size
        bias = shard_rows(linear.bias, r, t) if linear.bias is not None else None
        return cls(shard_rows(linear.weight, r, t), bias, comm, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel(x, [self], self.comm, self.sequence_parallel)[0]


class RowParallelLinear(nn.Module):
    """Rank ``rank``'s columns of a linear layer (its slice of the input features); the bias is
    whole on every rank and added after the partial outputs are summed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                 sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, sequence_parallel: bool = False):
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(shard_cols(linear.weight, comm.rank, comm.size), bias, comm, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = scatter_to_sequence_parallel(partial, self.comm)
        else:
            y = reduce_from_tensor_parallel(partial, self.comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows ``[r V/t, (r+1) V/t)`` of the token embedding. A token outside that
    range looks up nothing (zeros) here, so summing over ranks gives every token's row exactly
    once (Shoeybi et al. 2019, sec. 3): ``g`` (an all-reduce) or, with sequence parallelism,
    ``g_bar`` (a reduce-scatter, leaving each rank its slice of the sequence)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, comm: Comm,
                 sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = nn.Parameter(weight)
        per_rank = vocab_size // comm.size
        self.start, self.end = comm.rank * per_rank, (comm.rank + 1) * per_rank

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return scatter_to_sequence_parallel(partial, self.comm)
        return reduce_from_tensor_parallel(partial, self.comm)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, without gathering them (Shoeybi et al.
    2019, sec. 3): each rank holds [N, V/t] logits. The softmax needs two global figures per
    token, the maximum (for stability) and the sum of exponentials, and the loss needs the
    target's logit, which lives on one rank. So: an all-reduce(MAX) of N numbers, then one
    all-reduce(SUM) of 2N (sum of exponentials and target logit, fused into one message).
    Returns the per-token loss; saves the local softmax [N, V/t] for backward, whose gradient
    is ``softmax - onehot(target)`` restricted to this rank's columns."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, comm: Comm):
        logits = logits.float()
        top = logits.max(dim=-1).values
        max_all_reduce(top, comm)
        shifted = logits - top.unsqueeze(-1)
        outside = (target < start) | (target >= start + logits.shape[-1])
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), picked])
        comm.all_reduce(sums)
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local] -= (~outside).to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 comm: Comm) -> torch.Tensor:
    """Mean next-token loss from vocabulary-sharded logits [..., V/t]; the same on every rank."""
    flat = logits.reshape(-1, logits.shape[-1])
    return VocabParallelCrossEntropy.apply(flat, target.reshape(-1), start, comm).mean()
