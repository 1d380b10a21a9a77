"""Recursive doubling, and recursive halving-doubling (Rabenseifner), for any number of ranks.

Recursive doubling (Thakur, Rabenseifner & Gropp 2005): in step k rank v exchanges its whole
vector with rank v XOR 2^k and folds; after log2 N steps every rank has everything.
Few steps, but every step moves the whole vector:

    sent per rank = log2(N) * S,     T = log2(N) alpha + log2(N) S beta      (latency-optimal)

Rabenseifner's algorithm keeps the log2 N steps but halves the message each time: a reduce-
scatter by recursive halving (step k: keep one half of the current range, send the other half
to the partner, fold the partner's copy of the kept half), then an all-gather by recursive
doubling that retraces the steps. A rank ends the reduce-scatter holding 1/N of the vector:

    sent per rank = 2 (N-1)/N * S,   T = 2 log2(N) alpha + 2 (N-1)/N S beta

the ring's bandwidth term with a logarithmic latency term: what MPI libraries use for long
vectors and NCCL's tree comes close to.

N that is not a power of two (N = 2^k + r, 0 < r < 2^k): before the main part, each of the
first 2r ranks with an even number hands its whole vector to the next (odd) rank and sits out;
the 2^k remaining ranks run the algorithm; at the end each odd rank hands the result back.
That costs two extra steps and S bytes more for the 2r ranks involved (the standard fix in
Thakur et al. 2005). Ranges are halved by element count, so any size works.
"""
from __future__ import annotations

import torch.distributed as dist

from dlab.comm.algorithms.exchange import Exchange, Recv, Send


def _power_of_two_below(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class _Fold:
    """Maps the N real ranks onto 2^k virtual ones (see the module docstring)."""

    def __init__(self, n: int):
        self.p2 = _power_of_two_below(n)
        self.extra = n - self.p2

    def virtual(self, rank: int) -> int | None:
        if rank < 2 * self.extra:
            return rank // 2 if rank % 2 else None
        return rank - self.extra

    def real(self, v: int) -> int:
        return 2 * v + 1 if v < self.extra else v + self.extra

    def fold_in(self, ex: Exchange, blocks) -> int:
        """Step 0 (if N is not a power of two). Returns the first step of the main part."""
        if not self.extra:
            return 0
        me = ex.rank
        if me < 2 * self.extra:
            if me % 2 == 0:
                ex.step(0, sends=[Send(me + 1, ex.flat, blocks, reduce=True)])
            else:
                ex.step(0, recvs=[Recv(me - 1, ex.flat, blocks, reduce=True)])
        return 1

    def hand_back(self, ex: Exchange, blocks, step: int) -> int:
        if not self.extra:
            return step
        me = ex.rank
        if me < 2 * self.extra:
            if me % 2:
                ex.step(step, sends=[Send(me - 1, ex.flat, blocks)])
            else:
                ex.step(step, recvs=[Recv(me + 1, ex.flat, blocks)])
        return step + 1


def recursive_doubling_all_reduce(tensor, group=None, op="sum", trace=False):
    ex = Exchange("recursive-doubling", tensor, group, op, trace, chunks=1)
    fold = _Fold(ex.size)
    everything = (0,)
    step = fold.fold_in(ex, everything)
    v = fold.virtual(ex.rank)
    levels = fold.p2.bit_length() - 1
    if v is not None:
        for k in range(levels):
            partner = fold.real(v ^ (1 << k))
            ex.step(step + k, [Send(partner, ex.flat, everything, reduce=True)],
                    [Recv(partner, ex.flat, everything, reduce=True)])
    step = fold.hand_back(ex, everything, step + levels)
    return ex.finish(rounds=step)


def halving_bounds(numel: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` (a power of two) blocks made by halving [0, numel) recursively,
    each half split at its middle element: the ranges recursive halving exchanges."""
    bounds = [0, numel]
    while len(bounds) - 1 < parts:
        halves = [(a, a + (b - a) // 2) for a, b in zip(bounds, bounds[1:], strict=False)]
        bounds = [x for pair in halves for x in pair] + [numel]
    return bounds


def rabenseifner_all_reduce(tensor, group=None, op="sum", trace=False):
    ex = Exchange("rabenseifner", tensor, group, op, trace,
                  chunks=_power_of_two_below(dist.get_world_size(group)))
    fold = _Fold(ex.size)
    p2 = fold.p2
    bounds = halving_bounds(ex.flat.numel(), p2)
    every_block = tuple(range(p2))
    step = fold.fold_in(ex, every_block)
    v = fold.virtual(ex.rank)
    levels = p2.bit_length() - 1

    def part(a: int, b: int) -> tuple:  # leaves [a, b) as (flat slice, their block numbers)
        return ex.flat[bounds[a]:bounds[b]], tuple(range(a, b))

    if v is not None:
        a, b = 0, p2  # the leaves this rank is responsible for
        for k in range(levels):  # reduce-scatter by recursive halving
            mask = p2 >> (k + 1)
            partner, mid = fold.real(v ^ mask), (a + b) // 2
            lower, upper = (a, mid), (mid, b)  # the lower virtual rank keeps the lower half
            (keep_a, keep_b), given = (lower, upper) if not v & mask else (upper, lower)
            give, give_blocks = part(*given)
            keep, keep_blocks = part(keep_a, keep_b)
            ex.step(step + k, [Send(partner, give, give_blocks, reduce=True)],
                    [Recv(partner, keep, keep_blocks, reduce=True)])
            a, b = keep_a, keep_b
        for k in range(levels):  # all-gather by recursive doubling, retracing the halving
            mask = 1 << k
            partner, width = fold.real(v ^ mask), b - a
            theirs = (b, b + width) if not v & mask else (a - width, a)
            mine_t, mine_blocks = part(a, b)
            their_t, their_blocks = part(*theirs)
            ex.step(step + levels + k, [Send(partner, mine_t, mine_blocks)],
                    [Recv(partner, their_t, their_blocks)])
            a, b = min(a, theirs[0]), max(b, theirs[1])
    step = fold.hand_back(ex, every_block, step + 2 * levels)
    return ex.finish(rounds=step)
