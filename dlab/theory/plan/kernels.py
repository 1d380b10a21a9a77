"""What one kernel costs on one device: the roofline (Williams et al. 2009), per operation.

An operation takes ``max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency))`` plus
a fixed launch cost, the three kinds of work a training step does priced apart:

- a **matmul** of an (m x k) by a (k x n) matrix: 2 m n k FLOPs at the share of peak the
  device's best GEMM reaches (``Kernels.matmul``: the "maximum achievable matmul FLOPS" of
  Bekman's table, the best shape a brute-force search found, ``Kernels.best``), scaled by what
  its shape loses against that best one: *tile quantization* (an output dimension that is not a
  multiple of the library's tile leaves part of the last tile idle), *wave quantization* (the
  tiles of all the batch's GEMMs run in waves of one per streaming multiprocessor; a last wave
  that is partly full idles the rest): NVIDIA's "Matrix Multiplication Background User's Guide"
  (Deep Learning Performance docs); and the *fill* of each tile's pipeline (a tile's main loop
  runs k / tile_k steps, and filling its software pipeline and writing the tile back cost about
  ``fill`` more: four stages and the epilogue's two, so a short reduction dimension k is paid
  for). Its bytes (both inputs and the output, once) at the memory bandwidth bound it from
  below: a skinny matmul (a small m, as at a micro-batch of a few tokens) is memory-bound.
- a **fused attention** kernel (FlashAttention and its kin): its FLOPs at the kernel's own share
  of peak (forward and backward apart: Dao 2023, FlashAttention-2, 50-73 % of an A100's peak
  forward; Shah et al. 2024, FlashAttention-3, 75 % of an H100's forward, and FlashAttention-2
  there about 35 %), reached as the keys grow: ``s / (s + attention_half)`` of it at s keys
  (both papers' figures climb from half their plateau at a few hundred keys).
- a **memory-bound** operation (a norm, an activation function, a residual add, a softmax, the
  loss, the optimizer): its bytes read and written at the share of the memory bandwidth a
  streaming kernel reaches (``Kernels.hbm``).

Where ``python -m dlab plan calibrate`` measured this device, its tables replace the curves:
``matmul_table`` (m, n, k, FLOP/s) and ``attention_table`` (keys, forward FLOP/s, backward
FLOP/s), interpolated in log space between the measured shapes around the one asked for
(``table_rate``).

Every rate is further multiplied by ``sustained``: the share of a kernel's benchmarked rate it
keeps inside a training step (clocks under a step's sustained power, caches the neighbouring
kernels evicted). It is the one constant the published rows choose
(``dlab.theory.plan.published.fit``, scored leave-one-source-out); everything else is a
hardware figure.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernels:
    """How fast one device runs each kind of kernel (module docstring)."""

    #: the best share of peak a bf16 GEMM reaches (MAMF / datasheet peak)
    matmul: float
    #: streaming multiprocessors (wave quantization); 0: none (a CPU)
    sms: int
    #: the library's tile: output rows, output columns, and the reduction step of its main loop
    tile: tuple[int, int, int]
    #: (kernel name, forward, backward share of peak) of each fused attention kernel
    attention: tuple = ()
    #: keys at which a fused attention kernel reaches half its share
    attention_half: int = 512
    #: the share of the memory bandwidth a streaming kernel reaches
    hbm: float = 0.85
    #: seconds a kernel costs however small (launch and tail)
    launch: float = 3e-6
    #: measured (m, n, k, FLOP/s) of GEMMs; replaces the quantization curve when present
    matmul_table: tuple = ()
    #: measured (keys, forward FLOP/s, backward FLOP/s) of the fused causal attention
    attention_table: tuple = ()
    #: the (m, n, k) at which ``matmul`` was measured (MAMF's best shape)
    best: tuple = (8192, 8192, 8192)
    #: main-loop steps a tile's pipeline fill and epilogue cost
    fill: float = 6.0


def _quantized(x: int, tile: int) -> float:
    """The share of the tiles covering ``x`` that ``x`` fills."""
    return x / (math.ceil(x / tile) * tile)


def _shape_factor(kernels: Kernels, m: int, n: int, k: int, batch: float = 1) -> float:
    """What a shape keeps of a tile-perfect, wave-perfect, fill-free GEMM (module docstring).
    An output smaller than a tile runs in a kernel made for it (a GEMV, split-K): it pays no
    quantization, and its bytes bound it."""
    tm, tn, tk = kernels.tile
    out = k / (k + kernels.fill * tk)
    if m < tm or n < tn:
        return out
    out *= _quantized(m, tm) * _quantized(n, tn)
    if kernels.sms:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = tiles / kernels.sms
        out *= waves / math.ceil(waves)
    return out


@functools.lru_cache(maxsize=65536)
def matmul_efficiency(kernels: Kernels, m: int, n: int, k: int, batch: float = 1) -> float:
    """Share of peak a (batch of) GEMM(s) of this shape reaches (module docstring): the best
    shape's measured share, times this shape's factor over the best shape's."""
    return kernels.matmul * _shape_factor(kernels, m, n, k, batch) / _shape_factor(kernels, *kernels.best)


def nearest(table: tuple, key: tuple) -> tuple:
    """The row of ``table`` whose leading entries are nearest ``key`` in log space."""
    def distance(row):
        return sum((math.log(max(a, 1)) - math.log(max(b, 1))) ** 2 for a, b in zip(row, key))
    return min(table, key=distance)


def _bracket(values: tuple, x: float) -> tuple[tuple[float, float], ...]:
    """(value, weight) of the measured values either side of ``x``, linear in log space; one
    value at weight 1 outside their span (a rate is not extrapolated)."""
    if x <= values[0]:
        return ((values[0], 1.0),)
    if x >= values[-1]:
        return ((values[-1], 1.0),)
    hi = next(i for i, v in enumerate(values) if v >= x)
    a, b = values[hi - 1], values[hi]
    t = math.log(x / a) / math.log(b / a)
    return ((a, 1.0 - t), (b, t))


def table_rate(table: tuple, key: tuple, column: int) -> float:
    """The measured rate ``row[column]`` at ``key``. A table measured on a full grid (every
    combination of its values per dimension, as ``plan calibrate`` measures) is interpolated
    multilinearly in log space, its rates geometrically, between the measured shapes around
    ``key``; any other table gives its nearest row's (``nearest``). The first H200 profile
    priced 8192 x 8192 x 1024 at the nearest row's 4096 x 8192 x 512 (439 TFLOP/s), where
    the shape half-way to 2048 in k (677) lies as near."""
    dims = len(key)
    values = [tuple(sorted({row[d] for row in table})) for d in range(dims)]
    if len(table) != math.prod(len(v) for v in values) or len({row[:dims] for row in table}) != len(table):
        return nearest(table, key)[column]
    rate = {row[:dims]: row[column] for row in table}
    corners = [()]
    for d in range(dims):
        corners = [(c + ((v, w),)) for c in corners for v, w in _bracket(values[d], key[d])]
    log_rate = sum(math.prod(w for _, w in c) * math.log(rate[tuple(v for v, _ in c)]) for c in corners)
    return math.exp(log_rate)


def matmul_time(cluster, m: int, n: int, k: int, elt: int = 2, sustained: float = 1.0,
                batch: float = 1) -> float:
    """Seconds of ``batch`` (m x k) @ (k x n) GEMMs of ``elt``-byte elements, one launch
    (module docstring)."""
    kern = cluster.kernels
    flops = 2.0 * m * n * k * batch
    if kern.matmul_table:
        rate = table_rate(kern.matmul_table, (m, n, k), 3)
    else:
        rate = cluster.peak * matmul_efficiency(kern, m, n, k, batch)
    moved = elt * batch * (m * k + k * n + m * n)
    return max(flops / (rate * sustained), moved / (cluster.hbm * kern.hbm)) + kern.launch


def attention_rate(cluster, kernel: str, keys: float, backward: bool) -> float:
    """FLOP/s of a fused attention kernel over ``keys`` keys per query (module docstring)."""
    kern = cluster.kernels
    if kern.attention_table:
        return table_rate(kern.attention_table, (keys,), 2 if backward else 1)
    forward, back = next((f, b) for name, f, b in kern.attention if name == kernel)
    return cluster.peak * (back if backward else forward) * keys / (keys + kern.attention_half)


def attention_time(cluster, kernel: str, flops: float, keys: float, backward: bool,
                   sustained: float = 1.0, calls: int = 1) -> float:
    """Seconds of ``calls`` fused attention kernels doing ``flops`` in all."""
    rate = attention_rate(cluster, kernel, keys, backward) * sustained
    return flops / rate + calls * cluster.kernels.launch


def memory_time(cluster, nbytes: float, kernels: float = 1.0) -> float:
    """Seconds of memory-bound work moving ``nbytes`` in ``kernels`` launches."""
    return nbytes / (cluster.hbm * cluster.kernels.hbm) + kernels * cluster.kernels.launch
