"""Gradient compression for ``ddp``: send fewer bytes per bucket, pay in accuracy or in state.

At scale the all-reduce of every gradient each step is what stops data parallelism from
scaling (2 (N-1)/N * P bytes per rank and step whatever N is). Each compressor here takes one
``ddp`` bucket (its flat fp32 gradient buffer and the parameters whose ``.grad`` are views into
it), leaves there the average over the ranks of what its rule lets through, and does its own
communication through the bucket's counting ``Comm`` so every byte is counted. ``ddp`` runs it
on its communication thread as each bucket fills, so compression still overlaps backward.

- ``fp16`` / ``bf16`` (``Cast``): cast the bucket to 16 bits, divide by N, all-reduce in 16
  bits, cast back: half the bytes, no state. The order of PyTorch's ``fp16_compress_hook``
  (``buffer.to(dtype).div_(N)``), so at 2 ranks it gives the hook's numbers exactly. fp16 has
  5 exponent bits: gradients below ~6e-5 lose precision (subnormals) and below ~6e-8 vanish;
  bf16 keeps fp32's range with 8 bits of mantissa (Kalamkar et al. 2019). Gloo sums bf16 on the
  CPU (probed with torch 2.13 at 2 and 4 ranks), so both run here.
- ``powersgd`` (``PowerSGD``): Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank
  Gradient Compression for Distributed Optimization", NeurIPS 2019, Algorithm 1 with error
  feedback and warm start, following the rule of PyTorch's ``powerSGD_hook``.
- ``topk`` (``TopK``): sparsification with memory (Stich, Cordonnier & Jaggi, "Sparsified SGD
  with Memory", NeurIPS 2018; Lin et al., "Deep Gradient Compression", ICLR 2018).

``dlab.theory.compression`` has the bytes each sends, derived from the papers apart from this
code; tests/test_compression.py checks both against runs and each rule against a one-process
re-implementation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dlab.parallel.data_parallel.buckets import Bucket

METHODS = ("none", "fp16", "bf16", "powersgd", "topk")
CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: PyTorch's PowerSGDState defaults that dlab shares: rank 1, and a matrix is compressed only
#: if that sends less than half its entries
POWERSGD_RANK = 1
MIN_COMPRESSION_RATE = 2
#: steps of plain all-reduce before PowerSGD compresses: PyTorch's smallest
#: ``start_powerSGD_iter`` with error feedback (its DDP rebuilds buckets after step 0)
POWERSGD_START = 2
TOPK_RATIO = 0.01


def average(comm, flat: torch.Tensor) -> None:
    """Plain data parallelism: divide by N, all-reduce (the sum of g_i / N)."""
    flat.div_(comm.size)
    comm.all_reduce(flat)


def param_views(bucket: Bucket) -> list[torch.Tensor]:
    """Each parameter's gradient as a view into the bucket, in bucket order."""
    views, offset = [], 0
    for p in bucket.params:
        views.append(bucket.flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


class Cast:
    """``fp16`` / ``bf16``: all-reduce the bucket in 16 bits. No error feedback (PyTorch's hook
    has none): the rounding of each step is lost, not carried."""

    op = "all_reduce"

    def __init__(self, name: str, comm):
        self.name, self.dtype, self.comm = name, CAST[name], comm

    def reduce(self, bucket: Bucket) -> None:
        low = bucket.flat.to(self.dtype).div_(self.comm.size)
        self.comm.all_reduce(low)
        bucket.flat.copy_(low)

    def state_bytes(self) -> int:
        return 0


def orthonormalise(a: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of ``a`` (n x r), in place, as the paper does. A column of
    zeros stays zero (PyTorch's default epsilon of 0 would make it NaN)."""
    tiny = torch.finfo(a.dtype).tiny
    for i in range(a.shape[1]):
        col = a[:, i:i + 1]
        col.div_(col.norm().clamp_min(tiny))
        rest = a[:, i + 1:]
        rest.sub_(col @ (col.T @ rest))


def compressed_rank(shape: torch.Size, rank: int) -> int:
    """The rank a gradient of ``shape`` is compressed at, 0 if it is sent whole. PyTorch's
    rule: the tensor as an n x m matrix (``view(shape[0], -1)``) at rank r' = min(n, m, r) is
    compressed when (n + m) r' * MIN_COMPRESSION_RATE < n m; vectors never are."""
    if len(shape) < 2:
        return 0
    n = shape[0]
    m = shape.numel() // n
    r = min(n, m, rank)
    return r if (n + m) * r * MIN_COMPRESSION_RATE < n * m else 0


@dataclass
class _LowRank:
    """One compressed gradient: the matrix M (n x m, a view into the bucket), its error, and its
    factors P (n x r) and Q (m x r), views into the bucket's two messages."""

    matrix: torch.Tensor
    p: torch.Tensor
    q: torch.Tensor
    error: torch.Tensor


@dataclass
class _Plan:
    """A bucket's gradients, split: sent whole (in one message) or low rank (P and Q messages)."""

    whole: list[torch.Tensor]
    low: list[_LowRank]
    p_msg: torch.Tensor
    q_msg: torch.Tensor

    @classmethod
    def of(cls, bucket: Bucket, first_q: dict[int, torch.Tensor]) -> _Plan:
        whole, pairs = [], []
        for p, g in zip(bucket.params, param_views(bucket)):
            if id(p) in first_q:
                pairs.append((g.view(g.shape[0], -1), first_q[id(p)]))
            else:
                whole.append(g)
        p_msg = bucket.flat.new_zeros(sum(matrix.shape[0] * q0.shape[1] for matrix, q0 in pairs))
        q_msg = bucket.flat.new_zeros(sum(q0.numel() for _, q0 in pairs))
        low, p_at, q_at = [], 0, 0
        for matrix, q0 in pairs:
            (n, m), r = matrix.shape, q0.shape[1]
            q = q_msg[q_at:q_at + m * r].view(m, r)
            q.copy_(q0)
            low.append(_LowRank(matrix, p_msg[p_at:p_at + n * r].view(n, r), q, torch.zeros_like(matrix)))
            p_at, q_at = p_at + n * r, q_at + m * r
        return cls(whole, low, p_msg, q_msg)


class PowerSGD:
    """Rank-r PowerSGD with error feedback and warm start (Vogels et al. 2019, Algorithm 1).

    Per bucket and step, once ``start`` steps of plain all-reduce have passed:

    1. vectors, and matrices whose compression would save less than half (PyTorch's
       ``min_compression_rate`` = 2), are all-reduced whole, in one message, and divided by N;
    2. each matrix M = G + e (the gradient plus the error it was not sent last step);
       P = M Q with Q last step's (warm start: one power-iteration step per training step);
       all-reduce the bucket's P's in one message (their sum: the scale does not matter, P is
       orthogonalised next); P <- Gram-Schmidt(P); Q = M^T P; all-reduce the Q's in one message
       and divide by N; the average is approximated by P Q^T; e = M - P Q^T stays on this rank.

    Per rank, 4 (n + m) r bytes sent in two all-reduces instead of 4 n m.

    Where this follows PyTorch's ``powerSGD_hook`` (so their bytes per step are equal): the
    matrix view and the compression test, ``start`` steps of plain all-reduce first (``start``
    may be 0 here: dlab's buckets never change, where PyTorch's DDP rebuilds them after step 0
    and therefore needs >= 2), P summed not averaged, Q re-orthogonalised before use (a
    numerical safeguard: Gram-Schmidt of M Q R^-1 equals that of M Q for triangular R), Q
    averaged and kept. Where it departs, and why:

    - Q's first value: drawn from N(0, 1) by one generator seeded with the run's seed, for each
      compressed parameter in registration order, so it is the same on every rank and does not
      depend on the bucket cap. PyTorch seeds the global RNG from NumPy per bucket.
    - vectors keep no error. PyTorch's error is the whole bucket's before minus after, which for
      an exactly averaged vector is g_i - mean(g): it sums to zero over the ranks and cancels
      in the next all-reduce, so leaving it out changes nothing but the rounding.
    - a bucket with no vector sends no empty message (PyTorch always sends three).
    """

    op = "all_reduce"
    name = "powersgd"

    def __init__(self, comm, buckets: list[Bucket], params: list[torch.nn.Parameter],
                 rank: int = POWERSGD_RANK, start: int = POWERSGD_START, seed: int = 0):
        self.comm, self.start = comm, start
        generator = torch.Generator().manual_seed(seed)
        first_q = {}  # Q_0 per compressed parameter, drawn in registration order
        for p in params:
            r = compressed_rank(p.shape, rank)
            if r:
                first_q[id(p)] = torch.randn(p.numel() // p.shape[0], r, generator=generator)
        self.plans = [_Plan.of(b, first_q) for b in buckets]
        self.steps = [0] * len(buckets)

    def reduce(self, bucket: Bucket) -> None:
        comm, n = self.comm, self.comm.size
        if self.steps[bucket.index] < self.start:
            self.steps[bucket.index] += 1
            average(comm, bucket.flat)
            return
        plan = self.plans[bucket.index]
        if plan.whole:
            msg = torch.cat([g.reshape(-1) for g in plan.whole])
            comm.all_reduce(msg)
            msg.div_(n)
            at = 0
            for g in plan.whole:
                g.copy_(msg[at:at + g.numel()].view_as(g))
                at += g.numel()
        if plan.low:
            for a in plan.low:
                a.matrix.add_(a.error)  # error feedback: what was not sent last step goes now
                orthonormalise(a.q)
                torch.matmul(a.matrix, a.q, out=a.p)
            comm.all_reduce(plan.p_msg)
            for a in plan.low:
                orthonormalise(a.p)
                torch.matmul(a.matrix.T, a.p, out=a.q)
            comm.all_reduce(plan.q_msg)
            plan.q_msg.div_(n)
            for a in plan.low:
                a.error.copy_(a.matrix)
                torch.matmul(a.p, a.q.T, out=a.matrix)  # the average, approximated: P Q^T
                a.error.sub_(a.matrix)

    def state_bytes(self) -> int:
        """Errors and the two messages' buffers (P, and Q, the warm start) of every bucket."""
        return sum(sum(a.error.nbytes for a in plan.low) + plan.p_msg.nbytes + plan.q_msg.nbytes
                   for plan in self.plans)


def topk_count(numel: int, ratio: float) -> int:
    """k for a bucket of ``numel`` entries: ratio * numel to the nearest whole number, at least 1."""
    return max(1, round(ratio * numel))


class TopK:
    """Top-k sparsification with error feedback (Stich et al. 2018; Lin et al. 2018).

    Per bucket and step: acc = e + g (the memory plus the new gradient); this rank keeps the k =
    ratio * numel entries of largest |acc| and sends them as (value, index) pairs; the memory
    becomes acc with those entries zeroed, so every coordinate is sent eventually (Stich et
    al.'s memory, which makes top-k converge at SGD's rate). Each rank picks other indices, so
    the pairs cannot be summed on the way as an all-reduce sums aligned buffers: they are
    all-gathered, summed into a dense bucket (rank 0's first, then rank 1's ...) and divided
    by N. Each rank receives (N-1) k pairs, which grows with N (DGC's scaling limit).

    Values and int32 indices travel in one message: the value bits are reinterpreted as int32
    (``view``, no conversion), so a bucket pays one all-gather's latency, not two. Not done:
    DGC's momentum correction, local gradient clipping and warm-up of the ratio, and its
    sampled threshold instead of an exact top-k; the memory holds gradients, not lr-scaled
    ones (the same with a constant learning rate).
    """

    op = "all_gather"
    name = "topk"

    def __init__(self, comm, buckets: list[Bucket], ratio: float = TOPK_RATIO):
        self.comm = comm
        self.memory = [torch.zeros_like(b.flat) for b in buckets]
        self.k = [topk_count(b.flat.numel(), ratio) for b in buckets]

    def reduce(self, bucket: Bucket) -> None:
        n, k, flat = self.comm.size, self.k[bucket.index], bucket.flat
        acc = self.memory[bucket.index].add_(flat)
        index = acc.abs().topk(k, sorted=False).indices
        mine = torch.cat([acc[index].view(torch.int32), index.to(torch.int32)])
        acc[index] = 0  # sent: it leaves the memory
        everyone = mine.new_empty(n * 2 * k)
        self.comm.all_gather_into_tensor(everyone, mine)
        flat.zero_()
        for values, where in everyone.view(n, 2, k):
            flat.index_add_(0, where.long(), values.view(flat.dtype))
        flat.div_(n)

    def state_bytes(self) -> int:
        return sum(m.nbytes for m in self.memory)


def make(config, comm, buckets: list[Bucket], params: list[torch.nn.Parameter]):
    """The compressor ``config.options`` asks for, or None for ``compress="none"``."""
    o = config.options
    method = o.get("compress", "none")
    if method in CAST:
        return Cast(method, comm)
    if method == "powersgd":
        return PowerSGD(comm, buckets, params, o.get("powersgd_rank", POWERSGD_RANK),
                        o.get("powersgd_start", POWERSGD_START), config.seed)
    if method == "topk":
        return TopK(comm, buckets, o.get("topk_ratio", TOPK_RATIO))
    return None
