"""Reduce-scatter, all-gather, broadcast and all-to-all from point-to-point messages, any N.

Each returns a ``Report`` like the all-reduces. How each handles sizes that do not divide:

- ``reduce_scatter``: the flattened input is cut at ``splits`` (default: near-equal, the larger
  chunks last, as ``chunk_bounds``); rank r gets chunk r. Ring schedule: N-1 steps, rank r sends
  every chunk but its own, (N-1)/N S when even (Patarasuk & Yuan 2009).
- ``all_gather``: rank r contributes ``splits[r]`` elements (default: all the same), so uneven
  gathers work, which Gloo's own all_gather does not do. Ring: N-1 steps, rank r sends every
  chunk but chunk r+1.
- ``broadcast``: binomial tree from ``src`` over ranks renumbered relative to it; round k doubles
  the ranks that have the data, so any N takes ceil(log2 N) rounds and a receiver gets S once.
  (For long vectors a scatter then ring all-gather, van de Geijn's broadcast, moves 2 S per rank
  instead of S log N on the root's link.)
- ``all_to_all``: rows of dim 0 by ``input_splits`` / ``output_splits`` (like
  ``all_to_all_single``; empty blocks allowed); N-1 shifted-pair steps, in step s rank r sends to
  r+s and receives from r-s, so no rank ever waits on two peers (Thakur et al. 2005).
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from dlab.comm.algorithms.exchange import Exchange, Recv, Send, chunk_bounds
from dlab.comm.algorithms.ring import all_gather_ring, reduce_scatter_ring, segments


def _bounds(numel: int, n: int, splits) -> list[int]:
    if splits is None:
        return chunk_bounds(numel, n)
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != numel:
        raise ValueError(f"splits {list(splits)} must be {n} non-negative counts summing to {numel}")
    return [0, *itertools.accumulate(splits)]


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, op="sum", trace=False,
                   splits: list[int] | None = None):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = _bounds(input.numel(), n, splits)
    if output.numel() != bounds[rank + 1] - bounds[rank]:
        raise ValueError(f"rank {rank}'s output has {output.numel()} elements, its chunk "
                         f"{bounds[rank + 1] - bounds[rank]} (chunks {bounds})")
    work = input.reshape(-1).clone()  # the input is left as it was, as dist.reduce_scatter does
    ex = Exchange("reduce-scatter", work, group, op, trace)
    reduce_scatter_ring(ex, list(range(n)), segments(bounds), 0)
    ex.finish(rounds=n - 1)
    output.copy_(work[bounds[rank]:bounds[rank + 1]].view_as(output))
    return ex.report


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, trace=False,
               splits: list[int] | None = None):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    splits = [input.numel()] * n if splits is None else list(splits)
    bounds = _bounds(output.numel(), n, splits)
    if input.numel() != splits[rank]:
        raise ValueError(f"rank {rank} gives {input.numel()} elements but splits[{rank}]={splits[rank]}")
    ex = Exchange("all-gather", output, group, "sum", trace)
    ex.flat[bounds[rank]:bounds[rank + 1]] = input.reshape(-1)
    if ex.holds is not None:  # before the gather a rank holds its own chunk only
        ex.holds = [{r} for r in range(n)]
    all_gather_ring(ex, list(range(n)), segments(bounds), 0)
    return ex.finish(rounds=n - 1)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, trace=False):
    ex = Exchange("broadcast", tensor, group, "sum", trace, chunks=1)
    n = ex.size
    v = (ex.rank - src) % n  # rank relative to the root
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    for k in range(rounds):
        mask = 1 << k
        if v < mask and v + mask < n:
            ex.step(k, sends=[Send((v + mask + src) % n, ex.flat, (0,))])
        elif mask <= v < 2 * mask:
            ex.step(k, recvs=[Recv((v - mask + src) % n, ex.flat, (0,))])
    return ex.finish(rounds=rounds)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None, group=None, trace=False):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, t, splits in (("input", input, input_splits), ("output", output, output_splits)):
        if splits is None and t.shape[0] % n:
            raise ValueError(f"{name} has {t.shape[0]} rows, which do not split evenly over {n} "
                             f"ranks: pass {name}_splits")
    rows_in = _bounds(input.shape[0], n, input_splits or [input.shape[0] // n] * n)
    rows_out = _bounds(output.shape[0], n, output_splits or [output.shape[0] // n] * n)
    ex = Exchange("all-to-all", output, group, "sum", trace, chunks=n * n)
    output[rows_out[rank]:rows_out[rank + 1]] = input[rows_in[rank]:rows_in[rank + 1]]
    if ex.holds is not None:  # chunk src * N + dst: the block src sends to dst
        ex.holds = [{b // n} for b in range(n * n)]
    for s in range(1, n):
        to, frm = (rank + s) % n, (rank - s) % n
        ex.step(s - 1, [Send(to, input[rows_in[to]:rows_in[to + 1]], (rank * n + to,))],
                [Recv(frm, output[rows_out[frm]:rows_out[frm + 1]], (frm * n + rank,))])
    return ex.finish(rounds=n - 1)
