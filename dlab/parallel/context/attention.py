"""Causal attention over a sequence split across the ranks of a group, three ways.

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
ring with the blocks, so they arrive home after n hops. Work the causal mask hides is skipped:
each rank's tokens are runs of consecutive positions (one chunk under the contiguous layout,
two under zigzag), so a block is cut into (query run, key run) tiles, and a tile the mask
hides entirely costs no FLOPs; a visible tile is computed with its mask (a run against itself,
the diagonal, is half hidden and computed whole, as FlashAttention's diagonal tiles are). That
is why the layout matters (``layout``): the tiles a rank computes are its causal work, and
zigzag gives every rank the same number.

``ulysses_attention`` (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns the
sequence split into a head split: every rank sends each other rank that rank's share of the
heads of its own tokens' Q, K and V, and receives, for its own h/n heads, every rank's tokens.
It attends over the whole sequence on those heads (an ordinary causal attention: the mask
comes from the gathered positions), and a second all-to-all sends each token's output back to
its owner. Every rank does exactly 1/n of the attention whatever the layout, and the bytes per
rank do not grow with n; the limit is the head count: n must divide it (with grouped-query
attention, the KV heads). Each all-to-all's backward is the reverse all-to-all.

``usp_attention`` (Unified Sequence Parallelism, Fang and Zhao 2024): the two composed. The cp
group of n ranks is cut into n/u consecutive Ulysses groups of u ranks (inside a node, where the
all-to-all is cheap) and the ranks at the same place of each group form rings of n/u (across
nodes, where the ring's neighbour-only transfers hide behind compute). An all-to-all inside the
Ulysses group gives each rank h/u heads of the group's u shares of tokens; those heads then run
the ring over the groups, each group's tokens one ring block; a second all-to-all brings the
output back. u = n is Ulysses, u = 1 the ring. It lifts Ulysses' limit (u, not n, must divide
the heads) and cuts the ring's per-layer bytes from about 3n kv to about 3n/u kv + 4 kv.

Bytes per layer and step, kv = bytes of one rank's K and V: all-gather (n-1) kv forward and a
reduce-scatter of (n-1) kv backward; ring (n-1) kv forward, then (n-1) kv of blocks and n kv
of gradient accumulators backward; Ulysses (n-1)/n of Q, K, V and the output (2 kv) forward
and of their gradients backward, 4 (n-1)/n kv; USP 4 (u-1)/u kv inside the Ulysses group plus the
ring's (3r - 2) kv over r = n/u groups (a ring block is h/u heads of u shares of tokens, kv
again) (``dlab.theory.context``).
"""
from __future__ import annotations

import contextlib
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


def runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of the maximal runs of consecutive positions in ``positions``."""
    breaks = [0, *((positions[1:] != positions[:-1] + 1).nonzero().flatten() + 1).tolist(),
              len(positions)]
    return list(zip(breaks, breaks[1:]))


def tiles(positions: list[torch.Tensor]) -> list[list[slice]]:
    """Every rank's tokens cut into tiles of one size: the largest that divides every run of
    every rank (the layout's chunk: zigzag's middle rank holds two adjacent chunks as one run,
    and must be cut like the others for the work to balance)."""
    found = [runs(p) for p in positions]
    size = math.gcd(*(b - a for rs in found for a, b in rs))
    return [[slice(i, i + size) for a, b in rs for i in range(a, b, size)] for rs in found]


def visible_tiles(positions: list[torch.Tensor], rank: int) -> list[list[tuple]]:
    """For each source rank, the (query tile, key tile, mask) triples of ``rank``'s queries
    against that rank's keys that the causal mask does not hide entirely."""
    cut = tiles(positions)
    out = []
    for src in range(len(positions)):
        mask = positions[rank][:, None] >= positions[src][None, :]
        out.append([(qs, ks, mask[qs, ks]) for qs in cut[rank] for ks in cut[src] if mask[qs, ks].any()])
    return out


def computed_pairs(positions: list[torch.Tensor], rank: int) -> int:
    """The (query, key) score pairs ``rank`` computes per head and sequence: its visible tiles'
    sizes (the causal work, plus the hidden half of each diagonal tile)."""
    return sum(m.numel() for per_src in visible_tiles(positions, rank) for _, _, m in per_src)


class Ring:
    """One context-parallel group: its ``Comm``, every rank's token positions, and for each
    source rank the (query run, key run, mask) tiles of its block that the causal mask does not
    hide entirely."""

    def __init__(self, comm: Comm, positions: list[torch.Tensor], timeline=None):
        self.comm, self.positions = comm, positions
        self.rank, self.size = comm.rank, comm.size
        self.timeline = timeline  # if given, the tiles' compute is put on it ("attention_tiles")
        self.tiles = visible_tiles(positions, self.rank)

    def mask(self, src: int) -> torch.Tensor:
        """Which (my query, rank ``src``'s key) pairs the causal mask lets through."""
        return self.positions[self.rank][:, None] >= self.positions[src][None, :]

    def computing(self, direction: str):
        """A span around one block's tiles (not the waits for the next block): the rank's own
        attention work, which the layout balances or not."""
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span("attention_tiles", direction=direction)

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
            with ring.computing("forward"):
                for qs, ks, mask in ring.tiles[src]:
                    o[..., qs, :], lse[..., qs] = _merge(o[..., qs, :], lse[..., qs],
                                                         *_block(q[..., qs, :], kv[0][..., ks, :],
                                                                 kv[1][..., ks, :], mask, scale))
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
            with ring.computing("backward"):
                for qs, ks, mask in ring.tiles[src]:
                    k_t, v_t = kv[0][..., ks, :], kv[1][..., ks, :]
                    p = torch.exp(_scores(q[..., qs, :], k_t, mask, scale) - lse[..., qs, None])
                    ds = p * (do[..., qs, :] @ v_t.transpose(-2, -1) - delta[..., qs, :])
                    dq[..., qs, :] += ds @ k_t * scale
                    dkv[0][..., ks, :] += ds.transpose(-2, -1) @ q[..., qs, :] * scale
                    dkv[1][..., ks, :] += p.transpose(-2, -1) @ do[..., qs, :]
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


def _seq_to_head(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(b, h, t, d) with this rank's t tokens of every head -> (b, h/n, n t, d) with every rank's
    tokens (rank by rank) of this rank's h/n heads."""
    b, h, t, d = x.shape
    n = comm.size
    send = x.reshape(b, n, h // n, t, d).permute(1, 0, 2, 3, 4).contiguous()  # chunk j: rank j's heads
    recv = torch.empty_like(send)  # chunk j: rank j's tokens of my heads
    comm.all_to_all_single(recv, send)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def _head_to_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of ``_seq_to_head``."""
    b, hn, nt, d = x.shape
    n = comm.size
    send = x.reshape(b, hn, n, nt // n, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: rank j's tokens
    recv = torch.empty_like(send)  # chunk j: my tokens of rank j's heads
    comm.all_to_all_single(recv, send)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * hn, nt // n, d)


class _AllToAll(torch.autograd.Function):
    """``_seq_to_head`` (``to_heads``) or its inverse; the backward is the other one."""

    @staticmethod
    def forward(ctx, x, comm: Comm, to_heads: bool):
        ctx.comm, ctx.to_heads = comm, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, comm)

    @staticmethod
    def backward(ctx, g):
        return (_head_to_seq if ctx.to_heads else _seq_to_head)(g.contiguous(), ctx.comm), None, None


def ulysses_attention(q, k, v, ring: Ring) -> torch.Tensor:
    q, k, v = (_AllToAll.apply(t, ring.comm, True) for t in (q, k, v))
    order = torch.cat(ring.positions)  # the gathered tokens' positions, rank by rank
    mask = order[:, None] >= order[None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device))
    return _AllToAll.apply(o, ring.comm, False)


class Hybrid:
    """One USP group: the ``heads`` Comm (this rank's Ulysses group, u consecutive cp ranks)
    and the ``Ring`` over the groups (this rank and the ranks at its place in every other
    group), whose block positions are each group's tokens, rank by rank, as the all-to-all
    gathers them. ``positions``: every cp rank's."""

    def __init__(self, heads: Comm, across: Comm, positions: list[torch.Tensor], timeline=None):
        u = heads.size
        groups = [torch.cat(positions[j * u:(j + 1) * u]) for j in range(len(positions) // u)]
        self.heads, self.ring = heads, Ring(across, groups, timeline)


def usp_attention(q, k, v, ring: Hybrid) -> torch.Tensor:
    q, k, v = (_AllToAll.apply(t, ring.heads, True) for t in (q, k, v))
    return _AllToAll.apply(ring_attention(q, k, v, ring.ring), ring.heads, False)
