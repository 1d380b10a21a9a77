"""Ring all-reduce: a reduce-scatter, then an all-gather, around a ring of N ranks.

The vector is cut into N chunks. In reduce-scatter step s (s = 0 .. N-2) rank i sends chunk
(i-s-1) mod N to its right neighbour and folds chunk (i-s-2) mod N, arriving from its left,
into its own copy; after N-1 steps rank i holds chunk i reduced over all ranks. The all-gather
then passes the finished chunks round the same ring for N-1 more steps. Every rank sends
2 (N-1) messages of S/N bytes:

    sent per rank = 2 (N-1)/N * S,    T = 2 (N-1) alpha + 2 (N-1)/N * S * beta

which is optimal in bandwidth for any N (Patarasuk & Yuan 2009) but linear in N in latency.
Any N works: chunks are near-equal (sizes differ by one element at most), and a rank's bytes
are then exactly 2 S - c_i - c_(i+1), the chunks it never sends.

The two halves are written for any list of ranks (``members``) and any segments, so the
hierarchical algorithm and the reduce-scatter / all-gather collectives reuse them.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlab.comm.algorithms.exchange import Exchange, Recv, Send, chunk_bounds


@dataclass(frozen=True)
class Segment:
    lo: int  # element range [lo, hi) of the flat tensor
    hi: int
    blocks: tuple[int, ...]  # the trace chunks it covers


def segments(bounds: list[int], blocks_per: int = 1, first_block: int = 0) -> list[Segment]:
    return [Segment(bounds[i], bounds[i + 1],
                    tuple(range(first_block + i * blocks_per, first_block + (i + 1) * blocks_per)))
            for i in range(len(bounds) - 1)]


def reduce_scatter_ring(ex: Exchange, members: list[int], segs: list[Segment], step0: int) -> int:
    """After it, the rank at position i of ``members`` holds ``segs[i]`` reduced over members.
    Returns the next free step number."""
    n = len(members)
    i = members.index(ex.rank)
    right, left = members[(i + 1) % n], members[(i - 1) % n]
    for s in range(n - 1):
        out, into = segs[(i - s - 1) % n], segs[(i - s - 2) % n]
        ex.step(step0 + s,
                [Send(right, ex.flat[out.lo:out.hi], out.blocks, reduce=True)],
                [Recv(left, ex.flat[into.lo:into.hi], into.blocks, reduce=True)])
    return step0 + n - 1


def all_gather_ring(ex: Exchange, members: list[int], segs: list[Segment], step0: int) -> int:
    """The rank at position i holds ``segs[i]``; afterwards every member holds all of them."""
    n = len(members)
    i = members.index(ex.rank)
    right, left = members[(i + 1) % n], members[(i - 1) % n]
    for s in range(n - 1):
        out, into = segs[(i - s) % n], segs[(i - s - 1) % n]
        ex.step(step0 + s,
                [Send(right, ex.flat[out.lo:out.hi], out.blocks)],
                [Recv(left, ex.flat[into.lo:into.hi], into.blocks)])
    return step0 + n - 1


def ring_all_reduce(tensor, group=None, op="sum", trace=False, piece_bytes: int = 1 << 20):
    ex = Exchange("ring", tensor, group, op, trace, piece_bytes=piece_bytes)
    n = ex.size
    segs = segments(chunk_bounds(ex.flat.numel(), n))
    members = list(range(n))
    step = reduce_scatter_ring(ex, members, segs, 0)
    step = all_gather_ring(ex, members, segs, step)
    return ex.finish(rounds=step)
