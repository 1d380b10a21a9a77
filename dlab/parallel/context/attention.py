"""Causal attention over a sequence split across the ranks of a group, two ways.

Each rank holds the queries, keys and values of its own tokens (``layout.positions``); a query
may attend to every key at or before its position, wherever that key lives. Both functions
take (batch, heads, local tokens, head_dim) tensors and return this rank's attention output.

``allgather_attention`` (naive): gather every rank's K and V, then attend locally. Autograd
runs the reverse: the gradients of the gathered K and V are reduce-scattered back to their
owners. Simple and the fewest bytes, but each rank holds, and saves for backward, the K and V
of the *whole* sequence, so activation memory no longer shrinks with the number of ranks, and
nothing overlaps the gather.

``ring_attention`` (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the K/V
blocks travel around the ring, one hop per step, while each rank attends to the block it holds
and merges the partial results with the online softmax of FlashAttention (Dao et al. 2022):
for two partial results (o1, lse1) and (o2, lse2) over disjoint key sets,
    lse = log(e^lse1 + e^lse2),   o = o1 e^(lse1 - lse) + o2 e^(lse2 - lse).
A rank never holds more than two K/V blocks, and the next block's transfer overlaps the current
block's compute. The backward pass (a hand-written autograd Function) recomputes each block's
probabilities from the saved log-sum-exp and sends the K/V gradient accumulators around the
ring with the blocks, so they arrive home after n hops. Blocks that the causal mask hides
entirely are skipped (no FLOPs): that is why the layout matters (``layout``). A partly hidden
block is computed whole and masked; production kernels split a zigzag block into its chunk
pairs and skip the hidden quarter, which this version leaves out for readability.

Bytes per layer and step, kv = bytes of one rank's K and V: all-gather (n-1) kv forward and a
reduce-scatter of (n-1) kv backward; ring (n-1) kv forward, then (n-1) kv of blocks and n kv
of gradient accumulators backward (``dlab.estimate.context``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dlab.comm.instrumented import Comm


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row that sees no key yet) read as 0, so exp(-inf - 0) = 0 instead of NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _scores(q, k, mask, scale) -> torch.Tensor:
    return (q @ k.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))


def _block(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` to one key block: (softmax-weighted values, log-sum-exp per row)."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _finite(lse)[..., None]) @ v, lse


def _merge(o, lse, o_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial results over disjoint key sets."""
    new = torch.logaddexp(lse, lse_b)
    base = _finite(new)
    return (o * torch.exp(lse - base)[..., None] + o_b * torch.exp(lse_b - base)[..., None]), new


class Ring:
    """One context-parallel group: its ``Comm`` and every rank's token positions."""

    def __init__(self, comm: Comm, positions: list[torch.Tensor]):
        self.comm, self.positions = comm, positions
        self.rank, self.size = comm.rank, comm.size

    def mask(self, src: int) -> torch.Tensor:
        """Which (my query, rank ``src``'s key) pairs the causal mask lets through."""
        return self.positions[self.rank][:, None] >= self.positions[src][None, :]

    def shift(self, t: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Post the send of ``t`` to the next rank and the receive of the previous rank's;
        returns the receive buffer and the handles to wait on."""
        buf = torch.empty_like(t)
        send = self.comm.isend(t, (self.rank + 1) % self.size)
        recv = self.comm.irecv(buf, (self.rank - 1) % self.size)
        return buf, [send, recv]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        scale = 1 / math.sqrt(q.shape[-1])
        o = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])
        for i in range(ring.size):
            src = (ring.rank - i) % ring.size  # whose block this rank holds at step i
            if i < ring.size - 1:
                nxt, handles = ring.shift(kv)  # in flight while this block is computed
            mask = ring.mask(src)
            if mask.any():
                o, lse = _merge(o, lse, *_block(q, kv[0], kv[1], mask, scale))
            if i < ring.size - 1:
                for h in handles:
                    h.wait()
                kv = nxt
        ctx.ring, ctx.scale = ring, scale
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        # FlashAttention's backward, block by block: with P = exp(S - lse) recomputed,
        # dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO * O)), dQ = dS K s, dK = dS^T Q s.
        q, k, v, o, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        delta = (do * o).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for i in range(ring.size):
            src = (ring.rank - i) % ring.size
            if i < ring.size - 1:
                nxt, handles = ring.shift(kv)
            mask = ring.mask(src)
            if mask.any():
                p = torch.exp(_scores(q, kv[0], mask, scale) - lse[..., None])
                ds = p * (do @ kv[1].transpose(-2, -1) - delta)
                dq += ds @ kv[0] * scale
                dkv[0] += ds.transpose(-2, -1) @ q * scale
                dkv[1] += p.transpose(-2, -1) @ do
            if ring.size == 1:
                break
            # the accumulators follow their block: after n hops they are home, complete
            dkv, grad_handles = ring.shift(dkv)
            for h in grad_handles + (handles if i < ring.size - 1 else []):
                h.wait()
            if i < ring.size - 1:
                kv = nxt
        return dq, dkv[0], dkv[1], None


def ring_attention(q, k, v, ring: Ring) -> torch.Tensor:
    return _RingAttention.apply(q, k, v, ring)


class _Gather(torch.autograd.Function):
    """All-gather along a new leading dimension; its backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, comm: Comm):
        # the backends gather along dim 0: (n * x0, ...), viewed as (n, x0, ...)
        out = torch.empty(comm.size * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
        comm.all_gather_into_tensor(out, x.contiguous())
        ctx.comm = comm
        return out.view(comm.size, *x.shape)

    @staticmethod
    def backward(ctx, g):
        out = torch.empty(g.shape[1:], dtype=g.dtype, device=g.device)
        ctx.comm.reduce_scatter_tensor(out, g.reshape(-1, *g.shape[2:]).contiguous())
        return out, None


def allgather_attention(q, k, v, ring: Ring) -> torch.Tensor:
    gathered = _Gather.apply(torch.stack([k, v]), ring.comm)  # (n, 2, b, h, t, d)
    keys = torch.cat(list(gathered[:, 0]), dim=-2)  # every rank's tokens, rank by rank
    values = torch.cat(list(gathered[:, 1]), dim=-2)
    mask = ring.positions[ring.rank][:, None] >= torch.cat(ring.positions)[None, :]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(q.device))
