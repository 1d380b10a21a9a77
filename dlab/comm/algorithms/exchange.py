"""One rank's side of a hand-written collective: numbered steps of point-to-point messages.

Every algorithm in this package is a schedule of steps; in each step a rank posts some sends
and receives (``batch_isend_irecv``), waits for them, and folds what it received into its own
buffer with the reduction op. ``Exchange`` does exactly that and counts it into a ``Report``,
so the algorithms read as their schedules and nothing else.

Large messages are cut into pieces of ``piece_bytes`` posted as separate receives: the
reduction of piece j then runs while pieces j+1.. are still on the wire, which is the
overlap of computation with communication that makes a real ring keep up with the link.

With ``trace=True`` each data message is followed by a small provenance message (one row of
N flags per chunk it carries: whose contributions are in it), so the trace can name what every
chunk holds without any rank simulating the others. Provenance messages are not counted.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlab.comm.algorithms.report import Report, Transfer

OPS = ("sum", "max", "avg")
_DATA, _PROVENANCE = 0, 1
_scratch: dict[torch.dtype, torch.Tensor] = {}


def op_name(op) -> str:
    """Accept "sum" / "max" / "avg" or the matching ``dist.ReduceOp``."""
    if isinstance(op, str) and op.lower() in OPS:
        return op.lower()
    for name in OPS:
        if op == getattr(dist.ReduceOp, name.upper()):
            return name
    raise ValueError(f"op must be one of {OPS} (or dist.ReduceOp.SUM/MAX/AVG), got {op!r}")


def chunk_bounds(numel: int, n: int) -> list[int]:
    """Boundaries of ``n`` near-equal chunks (sizes differ by at most one element, the larger
    ones last): chunk i is ``[b[i], b[i+1])``. Works for any ``numel``, even smaller than n."""
    return [i * numel // n for i in range(n + 1)]


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reusable receive buffer: fresh large allocations cost a page fault per 4 KiB."""
    buf = _scratch.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = _scratch[dtype] = torch.empty(max(numel, 1), dtype=dtype)
    return buf[:numel]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


@dataclass
class Send:
    peer: int  # rank in the group
    data: torch.Tensor
    blocks: Sequence[int] = ()  # the trace chunks this message carries
    reduce: bool = False  # the receiver folds it in (recorded in the trace)


@dataclass
class Recv:
    peer: int
    into: torch.Tensor
    blocks: Sequence[int] = ()
    reduce: bool = False  # fold into ``into`` with the op (else overwrite it)


class Exchange:
    def __init__(self, algorithm: str, tensor: torch.Tensor, group=None, op="sum",
                 trace: bool = False, chunks: int | None = None, piece_bytes: int = 1 << 20):
        self.op = op_name(op)
        if self.op == "avg" and not tensor.is_floating_point():
            raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}: "
                             f"use op='sum' and divide yourself")
        self.tensor = tensor
        self.flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        chunks = self.size if chunks is None else chunks  # default: one chunk per rank
        self.piece = max(1, piece_bytes // max(tensor.element_size(), 1))
        self.report = Report(algorithm, self.rank, self.size, tensor.numel() * tensor.element_size(),
                             chunks=chunks, trace=[] if trace else None)
        self.holds = [{self.rank} for _ in range(chunks)] if trace else None
        self._steps: set[int] = set()
        self._pending: list = []

    def peer(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def fold(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        if self.op == "max":
            torch.maximum(acc, x, out=acc)
        else:
            acc.add_(x)

    def _pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.reshape(-1)  # a view: message buffers are contiguous slices
        return list(t.split(self.piece)) if t.numel() > self.piece else [t]

    def step(self, step: int, sends: Sequence[Send] = (), recvs: Sequence[Recv] = (),
             wait_sends: bool = True) -> None:
        """Post ``sends`` and ``recvs`` together, wait for the receives and fold them in.
        With ``wait_sends=False`` the sends may still be in flight on return (a pipeline keeps
        going); ``flush()`` waits for them, and the caller must not overwrite their data first."""
        sends = [s for s in sends if s.data.numel()]
        recvs = [r for r in recvs if r.into.numel()]
        if any(not r.into.is_contiguous() for r in recvs):
            raise ValueError("a receive buffer must be contiguous (a slice of a flat tensor)")
        if not sends and not recvs:
            return
        self._steps.add(step)
        tracing = self.holds is not None
        ops, landing, flags_in = [], [], []
        for s in sends:
            pieces = self._pieces(s.data)
            ops += [dist.P2POp(dist.isend, p, self.peer(s.peer), self.group, tag=_DATA) for p in pieces]
            self.report.sent_pieces += len(pieces)
            self.report.message_bytes += s.data.numel() * s.data.element_size()
            self.report.sent_bytes += s.data.numel() * s.data.element_size()
            self.report.messages += 1
            if tracing:
                ops.append(dist.P2POp(dist.isend, self._flags(s.blocks), self.peer(s.peer),
                                      self.group, tag=_PROVENANCE))
                self.report.trace += [Transfer(step, self.rank, s.peer, b,
                                               tuple(sorted(self.holds[b])), s.reduce)
                                      for b in s.blocks]
        offset = 0
        need = sum(r.into.numel() for r in recvs if r.reduce)
        buf = scratch(need, self.flat.dtype) if need else None
        for r in recvs:
            if r.reduce:
                dst = buf[offset:offset + r.into.numel()]
                offset += r.into.numel()
            else:
                dst = r.into
            pieces = self._pieces(dst)
            first = len(ops)
            ops += [dist.P2POp(dist.irecv, p, self.peer(r.peer), self.group, tag=_DATA) for p in pieces]
            landing.append((r, dst, pieces, first))
            self.report.recv_pieces += len(pieces)
            self.report.recv_bytes += dst.numel() * dst.element_size()
            if tracing:
                f = torch.empty(len(r.blocks), self.size, dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, f, self.peer(r.peer), self.group, tag=_PROVENANCE))
                flags_in.append((r, f))
        works = dist.batch_isend_irecv(ops)
        waited = set()
        if any(r.reduce and _overlap(r.into, s.data) for r in recvs for s in sends):
            # folding into a buffer that is still being sent would send the folded values
            for j in range(len(works)):
                if ops[j].op is dist.isend:
                    works[j].wait()
                    waited.add(j)
        for r, _, pieces, first in landing:
            # reduce each piece as soon as it lands, while the later ones are still arriving
            targets = self._pieces(r.into)
            for j, (p, t) in enumerate(zip(pieces, targets, strict=True)):
                works[first + j].wait()
                waited.add(first + j)
                if r.reduce:
                    self.fold(t, p)
        for j, w in enumerate(works):
            if j not in waited:  # a Gloo receive waited twice waits for a second message
                if wait_sends or ops[j].op is not dist.isend:
                    w.wait()
                else:
                    self._pending.append(w)
        for r, f in flags_in:
            for b, row in zip(r.blocks, f, strict=True):
                theirs = {i for i in range(self.size) if row[i]}
                self.holds[b] = self.holds[b] | theirs if r.reduce else theirs

    def _flags(self, blocks: Sequence[int]) -> torch.Tensor:
        f = torch.zeros(len(blocks), self.size, dtype=torch.uint8)
        for i, b in enumerate(blocks):
            f[i, list(self.holds[b])] = 1
        return f

    def flush(self) -> None:
        for w in self._pending:
            w.wait()
        self._pending = []

    def finish(self, rounds: int) -> Report:
        """Apply avg (a sum, then one division: what ``ReduceOp.AVG`` means), copy back a
        non-contiguous input, and return the report."""
        self.flush()
        if self.op == "avg":
            self.flat.div_(self.size)
        if not self.tensor.is_contiguous():  # we worked on a contiguous copy
            self.tensor.copy_(self.flat.view_as(self.tensor))
        self.report.rounds = rounds
        self.report.steps = len(self._steps)
        return self.report
