"""What gradient compression sends: bytes per rank and step for each of ``ddp``'s ``compress``
methods, from the parameter shapes, N, the bucket cap, PowerSGD's rank r and top-k's ratio.

Written from the papers' descriptions, apart from the strategy's code, so the tests compare two
derivations. Per rank and step, for fp32 gradients of P bytes in buckets b (ring convention, as
``dlab.theory.data_parallel.allreduce_bytes``; an all-gather sends (N-1)/N of its output):

    none       all-reduce of every bucket                  2 (N-1)/N * P
    fp16/bf16  the same in 16 bits                         2 (N-1)/N * P / 2
    powersgd   per n x m matrix (``view(n, -1)``) at rank r' = min(n, m, r), when it pays
               ((n + m) r' * 2 < n m, PyTorch's ``min_compression_rate``): P (n x r') and
               Q (m x r') all-reduced (Vogels et al. 2019, Alg. 1), 4 (n + m) r' bytes;
               vectors and matrices that do not pay all-reduced whole, 4 n m bytes:
                                                           2 (N-1)/N * 4 * sum(sent elements)
               (only from step ``start``; before it plain all-reduce, as ``none``)
    topk       per bucket of e entries, k = round(ratio * e) (at least 1) values and k int32
               indices from every rank, all-gathered (Stich et al. 2018; Lin et al. 2018):
                                                           (N-1)/N * N * sum_b 8 k_b

Compression ratios at scale: fp16 halves the bytes whatever N is; PowerSGD sends about
r (n + m) / (n m) of a matrix, independent of N; top-k's all-gather grows with N (each rank
receives (N-1) k pairs): it sends ratio * N times a plain all-reduce's bytes, more from
N = 1 / ratio on.

``messages`` lists each step's collectives (one per bucket, and for PowerSGD up to three),
``bytes_per_step`` their ring-model bytes, ``gloo_bytes_per_step`` what Gloo writes for them
(``dlab.comm.gloo``: its segments and framing), the figure measured on the wire.
"""
from __future__ import annotations

import math

from dlab.comm.gloo import gloo_all_gather_bytes, gloo_all_reduce_bytes
from dlab.theory.data_parallel import bucket_sizes

METHODS = ("none", "fp16", "bf16", "powersgd", "topk")
FP32 = 4
INDEX = 4  # int32 indices: a bucket holds fewer than 2^31 entries
MIN_COMPRESSION_RATE = 2  # PyTorch's PowerSGDState default


def buckets(shapes: list[tuple[int, ...]], cap_bytes: int) -> list[list[tuple[int, ...]]]:
    """The fp32 gradients of ``shapes`` (registration order) grouped into ``ddp``'s buckets: in
    reverse order, consecutive, sized by ``dlab.theory.data_parallel.bucket_sizes``."""
    ready = list(reversed(shapes))
    out, at = [], 0
    for size in bucket_sizes([FP32 * math.prod(s) for s in shapes], cap_bytes):
        group, filled = [], 0
        while filled < size:
            group.append(ready[at])
            filled += FP32 * math.prod(ready[at])
            at += 1
        out.append(group)
    return out


def low_rank(shape: tuple[int, ...], rank: int) -> tuple[int, int] | None:
    """Elements of P and of Q that PowerSGD all-reduces for a gradient of ``shape``: n r' and
    m r' for a matrix worth compressing, None where the tensor is sent whole."""
    if len(shape) < 2:
        return None
    n, m = shape[0], math.prod(shape) // shape[0]
    r = min(n, m, rank)
    return (n * r, m * r) if (n + m) * r * MIN_COMPRESSION_RATE < n * m else None


def topk_k(numel: int, ratio: float) -> int:
    return max(1, round(ratio * numel))


def messages(method: str, shapes: list[tuple[int, ...]], cap_bytes: int, world_size: int, *,
             rank: int = 1, ratio: float = 0.01, step: int = 0, start: int = 2
             ) -> list[tuple[str, int, int]]:
    """The step's collectives as (op, bytes, bytes per element): op "all_reduce" with its
    payload, or "all_gather" with its output (all ranks' blocks)."""
    if method not in METHODS:
        raise ValueError(f"no compression formula for {method!r}; known: {', '.join(METHODS)}")
    out = []
    for group in buckets(shapes, cap_bytes):
        numel = sum(math.prod(s) for s in group)
        if method == "none" or (method == "powersgd" and step < start):
            out.append(("all_reduce", FP32 * numel, FP32))
        elif method in ("fp16", "bf16"):
            out.append(("all_reduce", 2 * numel, 2))
        elif method == "powersgd":
            factors = [low_rank(s, rank) for s in group]
            whole = sum(math.prod(s) for s, f in zip(group, factors) if f is None)
            ps = sum(f[0] for f in factors if f)
            qs = sum(f[1] for f in factors if f)
            out += [("all_reduce", FP32 * e, FP32) for e in (whole, ps, qs) if e]
        else:
            out.append(("all_gather", world_size * topk_k(numel, ratio) * (FP32 + INDEX), FP32))
    return out


def bytes_per_step(method: str, shapes: list[tuple[int, ...]], cap_bytes: int, world_size: int,
                   **options) -> float:
    """Bytes one rank sends (= receives) in the step, ring convention. ``options``: ``rank``,
    ``ratio``, ``step``, ``start`` as for ``messages``."""
    n = world_size
    total = 0.0
    for op, size, _ in messages(method, shapes, cap_bytes, n, **options):
        total += (2 if op == "all_reduce" else 1) * (n - 1) / n * size
    return total


def gloo_bytes_per_step(method: str, shapes: list[tuple[int, ...]], cap_bytes: int, world_size: int,
                        rank_of: int, **options) -> int:
    """What rank ``rank_of`` writes to Gloo's TCP transport in the step, framing included."""
    n = world_size
    return sum(gloo_all_reduce_bytes(size, n, rank_of, element) if op == "all_reduce"
               else gloo_all_gather_bytes(size, n)
               for op, size, element in messages(method, shapes, cap_bytes, n, **options))
