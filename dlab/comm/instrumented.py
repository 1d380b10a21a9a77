"""Collectives that count what they move: the wrapper every strategy talks through.

``Comm`` wraps ``torch.distributed`` for one process group and records, per operation: calls,
payload bytes, time, and three byte figures that must not be confused:

- ``sent_bytes`` / ``recv_bytes``, the *model*. For the backend's collectives, the bytes of the
  bandwidth-optimal ring algorithm, the convention behind nccl-tests' "bus bandwidth" (Thakur
  et al. 2005; Patarasuk & Yuan 2009); for dlab's hand-written algorithms, the algorithm's own
  count of the payload it sent:

      all_reduce       sends 2 (N-1)/N * S     (reduce-scatter, then all-gather)
      all_gather       sends   (N-1)/N * S_out (each rank forwards N-1 of the N chunks)
      reduce_scatter   sends   (N-1)/N * S_in
      broadcast        sends S (pipelined chain: every rank but the last forwards the payload)
      all_to_all       sends   (N-1)/N * S     (all but its own block)
      send / recv      S

- ``wire_bytes``, *measured*: what this rank's process wrote to the transport during the op
  (``dlab.comm.wire``; busy periods of overlapping async ops are booked whole, mixed ones under
  ``"overlapped:<ops>"``). ``None`` where the backend's bytes cannot be seen (NCCL, not Linux).
- ``gloo_bytes``, the model of *Gloo's real algorithm* with its framing
  (``dlab.comm.gloo``): what ``wire_bytes`` should be on Gloo, and is, exactly, in
  tests/test_wire_bytes.py. Gloo's reduce-scatter is a whole all-reduce, twice the ring's
  bytes; ``reduce_scatter_algorithm = "ring"`` runs dlab's own ring reduce-scatter instead.

Async operations are timed from launch to ``wait()``. ``seconds`` is the plain sum of every
op's span, and overlapping async ops make it exceed the wall time; while ``spans`` is a list
(the training loop sets one per step) each op also appends ``(start, end, blocked)``, from
which ``dlab.core.events.comm_times`` takes the union: the busy and the exposed time.
"""
from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlab.comm import gloo as model
from dlab.comm.algorithms.collectives import reduce_scatter
from dlab.comm.wire import OVERLAPPED, meter

REDUCE_SCATTER_ALGORITHMS = ("backend", "ring")


def reduce_scatter_option(config) -> str:
    """The strategies' ``reduce_scatter`` option (declared in ``dlab.parallel.base``)."""
    return config.options.get("reduce_scatter", "backend")


def _plus(a, b):
    """Sum of two figures that may be unknown (None): unknown only if both are."""
    return b if a is None else a if b is None else a + b


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0  # the model: ring model (backend ops) or the algorithm's own count
    recv_bytes: float = 0.0
    seconds: float = 0.0
    wire_bytes: int | None = None  # measured on the wire; None: not measurable here
    gloo_bytes: int | None = None  # the model of Gloo's real algorithm, framing included

    def add(self, other: OpStats) -> None:
        self.calls += other.calls
        self.payload_bytes += other.payload_bytes
        self.sent_bytes += other.sent_bytes
        self.recv_bytes += other.recv_bytes
        self.seconds += other.seconds
        self.wire_bytes = _plus(self.wire_bytes, other.wire_bytes)
        self.gloo_bytes = _plus(self.gloo_bytes, other.gloo_bytes)


# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter (the old names warn);
# torch before it has only the old names, which take the same arguments.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Timed:
    """A work handle whose ``wait()`` adds the time since launch to the op's stats. Its wire
    window closes when the op completes (its future's callback, where the backend has one) or
    at ``wait()``, whichever comes first."""

    def __init__(self, comm, work, stats: OpStats, start: float, token):
        self.comm, self.work, self.stats, self.start = comm, work, stats, start
        self._token, self._lock = token, threading.Lock()
        if token is not None:
            try:
                work.get_future().add_done_callback(lambda _: self._close())
            except (RuntimeError, AttributeError):  # Gloo's send/recv works have no future
                pass

    def _close(self) -> None:
        with self._lock:
            if self._token is not None:
                token, self._token = self._token, None
                meter.end(token)

    def wait(self):
        begin = time.perf_counter()
        self.work.wait()
        self._close()
        self.comm.spent(self.stats, self.start)
        self.comm.blocked(begin)
        return True

    def is_completed(self) -> bool:
        """Whether the op has finished, without blocking (poll it, then ``wait()`` to count)."""
        return self.work.is_completed()

    def get_future(self):
        return self.work.get_future()


class _Done:
    """The handle of an op that ran to completion when it was called."""

    def wait(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


class Comm:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats: dict[str, OpStats] = defaultdict(OpStats)
        self.gloo = dist.get_backend(group) == "gloo"
        self.measurable = self.gloo and meter.available
        # "backend": the backend's reduce_scatter_tensor; "ring": dlab's ring (half Gloo's bytes)
        self.reduce_scatter_algorithm = "backend"
        self.spans: list[tuple[float, float, bool]] | None = None  # collected only when a list

    def spent(self, stats: OpStats, start: float, end: float | None = None,
              blocked: bool = False) -> None:
        """Book one op's time, ``start`` to ``end`` (now if None) on ``time.perf_counter``:
        its seconds, and its span if spans are collected. ``blocked``: the caller could do
        nothing else meanwhile (a blocking call), as against an op in flight behind other work."""
        end = time.perf_counter() if end is None else end
        stats.seconds += end - start
        if self.spans is not None:
            self.spans.append((start, end, blocked))

    def blocked(self, start: float) -> None:
        """The caller waited from ``start`` until now for an async op it launched earlier."""
        if self.spans is not None:
            self.spans.append((start, time.perf_counter(), True))

    # bookkeeping ------------------------------------------------------------------------
    def record(self, op: str, payload: int, sent: float, recv: float, seconds: float = 0.0,
               gloo: int | None = None) -> OpStats:
        s = self.stats[op]
        s.calls += 1
        s.payload_bytes += payload
        s.sent_bytes += sent
        s.recv_bytes += recv
        if seconds:  # an op timed by its caller, which waited for it
            self.spent(s, time.perf_counter() - seconds, blocked=True)
        if self.gloo and gloo is not None:
            s.gloo_bytes = (s.gloo_bytes or 0) + gloo
        if self.measurable and s.wire_bytes is None:
            s.wire_bytes = 0
        return s

    def _run(self, op: str, payload: int, sent: float, recv: float, call, async_op: bool,
             gloo: int | None = None):
        stats = self.record(op, payload, sent, recv, gloo=gloo)
        token = meter.begin(self, op, stats) if self.measurable else None
        start = time.perf_counter()
        try:
            work = call()
        except BaseException:
            if token is not None:
                meter.end(token)
            raise
        if async_op:
            return _Timed(self, work, stats, start, token)
        if token is not None:
            meter.end(token)
        self.spent(stats, start, blocked=True)
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
                         async_op, model.gloo_all_reduce_bytes(s, n, self.rank, t.element_size()))

    def all_gather_into_tensor(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        n, s = self.size, nbytes(out)
        wire = (n - 1) / n * s
        return self._run("all_gather", s, wire, wire,
                         lambda: _ALL_GATHER(out, t, group=self.group, async_op=async_op),
                         async_op, model.gloo_all_gather_bytes(s, n))

    def reduce_scatter_tensor(self, out: torch.Tensor, t: torch.Tensor,
                              op=dist.ReduceOp.SUM, async_op: bool = False):
        """With ``reduce_scatter_algorithm == "ring"``, dlab's ring reduce-scatter runs to
        completion here (an async call returns a finished handle: no overlap)."""
        n, s = self.size, nbytes(t)
        if self.reduce_scatter_algorithm == "ring":
            return self._ring_reduce_scatter(out, t, op, async_op)
        wire = (n - 1) / n * s
        return self._run("reduce_scatter", s, wire, wire,
                         lambda: _REDUCE_SCATTER(out, t, op=op, group=self.group,
                                                            async_op=async_op),
                         async_op, model.gloo_reduce_scatter_bytes(s, n, self.rank, t.element_size()))

    def _ring_reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op, async_op: bool):
        self.run_algorithm("reduce_scatter", nbytes(t),
                           lambda: reduce_scatter(out, t, group=self.group, op=op))
        return _Done() if async_op else None

    def run_algorithm(self, op: str, payload: int, call):
        """Run one of dlab's hand-written algorithms (``call()`` returns its ``Report``) inside a
        wire window, and record the bytes it counted as the model."""
        stats = self.stats[op]
        token = meter.begin(self, op, stats) if self.measurable else None
        start = time.perf_counter()
        try:
            report = call()
        finally:
            if token is not None:
                meter.end(token)
        self.record(op, payload, report.sent_bytes, report.recv_bytes, time.perf_counter() - start,
                    gloo=report.message_bytes + model.gloo_framing(report.sent_pieces, report.recv_pieces))
        return report

    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        """``src`` is a rank of this group."""
        s = nbytes(t)
        last = (src - 1) % self.size  # the end of the chain only receives
        sent = 0 if self.rank == last else s
        recv = 0 if self.rank == src else s
        g = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._run("broadcast", s, sent, recv,
                         lambda: dist.broadcast(t, g, group=self.group, async_op=async_op),
                         async_op, model.gloo_broadcast_bytes(s, self.size, self.rank, src))

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
                         async_op, model.gloo_all_to_all_bytes(int(s - own_in), n))

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._run("send", nbytes(t), nbytes(t), 0,
                  lambda: dist.send(t, self._global(dst), group=self.group), False,
                  model.gloo_send_bytes(nbytes(t)))

    def recv(self, t: torch.Tensor, src: int) -> None:
        self._run("recv", nbytes(t), 0, nbytes(t),
                  lambda: dist.recv(t, self._global(src), group=self.group), False,
                  model.gloo_recv_bytes())

    def isend(self, t: torch.Tensor, dst: int):
        return self._run("send", nbytes(t), nbytes(t), 0,
                         lambda: dist.isend(t, self._global(dst), group=self.group), True,
                         model.gloo_send_bytes(nbytes(t)))

    def irecv(self, t: torch.Tensor, src: int):
        return self._run("recv", nbytes(t), 0, nbytes(t),
                         lambda: dist.irecv(t, self._global(src), group=self.group), True,
                         model.gloo_recv_bytes())

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


__all__ = ["Comm", "OpStats", "OVERLAPPED", "REDUCE_SCATTER_ALGORITHMS", "nbytes",
           "reduce_scatter_option"]
