"""Collectives that count what they move: the wrapper every strategy talks through.

``Comm`` wraps ``torch.distributed`` for one process group and records, per operation: calls,
payload bytes, bytes this rank sends and receives, and time. For the backend's own collectives
the wire bytes are those of the bandwidth-optimal ring algorithm, the convention behind
nccl-tests' "bus bandwidth" (Thakur et al. 2005; Patarasuk & Yuan 2009):

    all_reduce       sends 2 (N-1)/N * S     (reduce-scatter, then all-gather)
    all_gather       sends   (N-1)/N * S_out (each rank forwards N-1 of the N chunks)
    reduce_scatter   sends   (N-1)/N * S_in
    broadcast        sends S (pipelined chain: every rank but the last forwards the payload)
    all_to_all       sends   (N-1)/N * S     (all but its own block)
    send / recv      S

and receives the same. dlab's hand-written algorithms (``dlab.comm.algorithms``) count the bytes
they actually send instead. Async operations are timed from launch to ``wait()``.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0
    recv_bytes: float = 0.0
    seconds: float = 0.0

    def add(self, other: OpStats) -> None:
        self.calls += other.calls
        self.payload_bytes += other.payload_bytes
        self.sent_bytes += other.sent_bytes
        self.recv_bytes += other.recv_bytes
        self.seconds += other.seconds


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Timed:
    """A work handle whose ``wait()`` adds the time since launch to the op's stats."""

    def __init__(self, work, stats: OpStats, start: float):
        self.work, self.stats, self.start = work, stats, start

    def wait(self):
        self.work.wait()
        self.stats.seconds += time.perf_counter() - self.start
        return True

    def get_future(self):
        return self.work.get_future()


class Comm:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats: dict[str, OpStats] = defaultdict(OpStats)

    # bookkeeping ------------------------------------------------------------------------
    def record(self, op: str, payload: int, sent: float, recv: float, seconds: float = 0.0) -> OpStats:
        s = self.stats[op]
        s.calls += 1
        s.payload_bytes += payload
        s.sent_bytes += sent
        s.recv_bytes += recv
        s.seconds += seconds
        return s

    def _run(self, op: str, payload: int, sent: float, recv: float, call, async_op: bool):
        stats = self.record(op, payload, sent, recv)
        start = time.perf_counter()
        work = call()
        if async_op:
            return _Timed(work, stats, start)
        stats.seconds += time.perf_counter() - start
        return None

    def snapshot(self) -> dict[str, dict]:
        return {op: dict(vars(s)) for op, s in self.stats.items()}

    def totals(self) -> OpStats:
        total = OpStats()
        for s in self.stats.values():
            total.add(s)
        return total

    # collectives ------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        n, s = self.size, nbytes(t)
        wire = 2 * (n - 1) / n * s
        return self._run("all_reduce", s, wire, wire,
                         lambda: dist.all_reduce(t, op=op, group=self.group, async_op=async_op),
                         async_op)

    def all_gather_into_tensor(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        n, s = self.size, nbytes(out)
        wire = (n - 1) / n * s
        return self._run("all_gather", s, wire, wire,
                         lambda: dist.all_gather_into_tensor(out, t, group=self.group,
                                                             async_op=async_op), async_op)

    def reduce_scatter_tensor(self, out: torch.Tensor, t: torch.Tensor,
                              op=dist.ReduceOp.SUM, async_op: bool = False):
        n, s = self.size, nbytes(t)
        wire = (n - 1) / n * s
        return self._run("reduce_scatter", s, wire, wire,
                         lambda: dist.reduce_scatter_tensor(out, t, op=op, group=self.group,
                                                            async_op=async_op), async_op)

    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        """``src`` is a rank of this group."""
        s = nbytes(t)
        last = (src - 1) % self.size  # the end of the chain only receives
        sent = 0 if self.rank == last else s
        recv = 0 if self.rank == src else s
        g = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._run("broadcast", s, sent, recv,
                         lambda: dist.broadcast(t, g, group=self.group, async_op=async_op),
                         async_op)

    def all_to_all_single(self, out: torch.Tensor, t: torch.Tensor, out_splits=None,
                          in_splits=None, async_op: bool = False):
        n, s = self.size, nbytes(t)
        row = math.prod(t.shape[1:]) * t.element_size()  # bytes per row, even with 0 rows
        own_in = (in_splits[self.rank] * row) if in_splits else s / n
        out_row = math.prod(out.shape[1:]) * out.element_size()
        own_out = (out_splits[self.rank] * out_row) if out_splits else nbytes(out) / n
        return self._run("all_to_all", s, s - own_in, nbytes(out) - own_out,
                         lambda: dist.all_to_all_single(out, t, out_splits, in_splits,
                                                        group=self.group, async_op=async_op),
                         async_op)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._run("send", nbytes(t), nbytes(t), 0,
                  lambda: dist.send(t, self._global(dst), group=self.group), False)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self._run("recv", nbytes(t), 0, nbytes(t),
                  lambda: dist.recv(t, self._global(src), group=self.group), False)

    def isend(self, t: torch.Tensor, dst: int):
        return self._run("send", nbytes(t), nbytes(t), 0,
                         lambda: dist.isend(t, self._global(dst), group=self.group), True)

    def irecv(self, t: torch.Tensor, src: int):
        return self._run("recv", nbytes(t), 0, nbytes(t),
                         lambda: dist.irecv(t, self._global(src), group=self.group), True)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank
