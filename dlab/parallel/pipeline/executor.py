"""Runs one rank's action list for one step: the only place a schedule turns into work.

The executor knows nothing of GPipe or 1F1B; it walks ``schedule.actions[rank]`` in order:

- ``forward``: input = the micro-batch's tokens (stage 0) or the received activation, made a
  leaf that requires grad, so the backward stops at the stage boundary and leaves the gradient
  to send in ``x.grad``. The last stage also computes the loss, divided by m: summing the
  micro-batches' gradients then gives exactly the gradient of the mean over the whole batch
  (gradient accumulation).
- ``backward``: autograd from the saved output with the received gradient (from the loss on
  the last stage); inside a zero-bubble schedule the weight matmuls are deferred.
- ``weight_grad``: runs the deferred weight gradients of that (stage, micro-batch).
- ``send``: posted with ``isend`` and not waited for (waited at the end of the step), so a
  send never blocks the schedule; ``recv`` blocks until the tensor is here. ``simulate.py``
  models exactly this, which is how ``validate`` proves a list cannot deadlock.

Receives posted ahead (``recv_ahead`` = k). A point-to-point transfer moves only once both
sides have posted: on Gloo's TCP transport the receiver announces its buffer and the sender's
I/O thread then writes the bytes. Posting each ``irecv`` only when the schedule reaches it puts
that handshake and the copy on the critical path of every receive, while the receiving rank
sits idle. With k > 0 the executor keeps the next k receives of its list posted, so the
transfer runs in the I/O threads while the rank computes, and the ``recv`` action only waits
for what is still missing (MPI's "post receives early"; Megatron-LM overlaps its pipeline p2p
the same way). It still *waits* at the same point of the list, so ``validate``'s no-deadlock
proof holds unchanged; the cost is k extra boundary buffers (``strategy.py`` says which k):
at a receive the rank holds its own buffer and the k posted after it, k + 1 in all where
posting at the action holds one (``posted_peak`` counts them from their storages: each is
registered with the rank's ``Transient`` when posted and leaves it, storage untouched, once it
has been waited for and handed to its stage as an input or an output gradient).
Not on NCCL: there a posted receive occupies the stream that the next send to the same peer
must also use, and two ranks that each post a receive before their send wait on each other
forever.

Every message carries a tag naming (sender stage, micro-batch, direction), so a receive can
never take another message of the same shape by mistake. Neighbouring stages on the same rank
(the V's turn) hand tensors over in memory, with no action in the list.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from dlab.comm.instrumented import Comm, nbytes
from dlab.core.events import Timeline
from dlab.core.metrics import ActivationMeter, Transient
from dlab.layout.schedules import Schedule
from dlab.parallel.pipeline.split import StageModule
from dlab.parallel.pipeline.weight_grad import WeightGradStore


def tag(sender: int, mb: int, receiver: int, n_stages: int) -> int:
    return 2 * (mb * n_stages + sender) + (receiver < sender)


class Executor:
    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, StageModule], comm: Comm,
                 timeline: Timeline, meter: ActivationMeter, store: WeightGradStore | None,
                 device: torch.device, transient: Transient, recv_ahead: int = 0):
        """``rank`` is this rank's position in its pipeline; ``comm`` counts traffic on the
        pipeline's process group (whose rank i holds pipeline position i); ``transient`` counts
        the posted receive buffers (kind ``recv``), shared with whatever else the rank holds
        for communication, and reset by the strategy at each step's start; ``recv_ahead``
        receives are kept posted before the actions that need them (0: post at the action)."""
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.comm, self.tl, self.meter, self.store, self.device = comm, timeline, meter, store, device
        self.transient = transient
        self.last = schedule.n_stages - 1
        self.recv_ahead = recv_ahead
        #: the dtype of the activations and gradients that travel (the compute dtype)
        self.act_dtype = torch.float32
        self.recvs = [a for a in schedule.actions[rank] if a.kind == "recv"]

    @property
    def posted_peak(self) -> int:
        """The most bytes of receive buffers posted and not yet handed to a stage, at once,
        since the transient's peak was reset (read from their storages each time one is
        posted)."""
        return self.transient.kind_peak.get("recv", 0)

    def _local(self, stage: int) -> bool:
        return 0 <= stage <= self.last and self.schedule.stage_rank[stage] == self.rank

    def _post_recv(self, a, act_shape: tuple[int, ...]):
        """Post the receive of action ``a``; returns (work, buffer)."""
        sched = self.schedule
        buf = self.transient.held("recv", torch.empty(act_shape, dtype=self.act_dtype, device=self.device))
        src = dist.get_global_rank(self.comm.group, sched.stage_rank[a.peer])
        self.comm.record("recv", nbytes(buf), 0, nbytes(buf))
        work = dist.irecv(buf, src, group=self.comm.group, tag=tag(a.peer, a.mb, a.stage, sched.n_stages))
        return work, buf

    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor],
            act_shape: tuple[int, ...]) -> torch.Tensor | None:
        """One step's actions; returns the summed (already /m) loss on the rank holding the
        last stage, else None. Gradients accumulate into the stages' parameters."""
        m, sched = len(inputs), self.schedule
        inbox: dict[tuple, torch.Tensor] = {}
        outbox: dict[tuple, torch.Tensor] = {}
        saved: dict[tuple, tuple] = {}
        sends: list = []
        # receives in list order; posted[j] is the j-th one's (work, buffer) once posted
        posted = [self._post_recv(r, act_shape) for r in self.recvs[: self.recv_ahead]]
        done = 0
        loss_sum = None
        for a in sched.actions[self.rank]:
            s, i = a.stage, a.mb
            with self.tl.span(a.kind, mb=i, stage=s):
                if a.kind == "forward":
                    stage = self.stages[s]
                    x = inputs[i] if s == 0 else inbox.pop((s, i, "act")).detach().requires_grad_()
                    with self.meter.track():
                        out = stage(x)
                        if s == self.last:
                            out = stage.criterion(out, targets[i]) / m
                    saved[(s, i)] = (x, out)
                    if s == self.last:
                        loss_sum = out.detach() if loss_sum is None else loss_sum + out.detach()
                    elif self._local(s + 1):
                        inbox[(s + 1, i, "act")] = out.detach()
                    else:
                        outbox[(s, i, s + 1)] = out.detach()
                elif a.kind == "backward":
                    x, out = saved.pop((s, i))
                    grad = None if s == self.last else inbox.pop((s, i, "grad"))
                    defer = self.store.deferring((s, i)) if sched.split_backward else contextlib.nullcontext()
                    # tracked too: a recomputed block saves its activations again here
                    with defer, self.meter.track():
                        torch.autograd.backward(out, grad)
                    if s > 0:
                        if self._local(s - 1):
                            inbox[(s - 1, i, "grad")] = x.grad
                        else:
                            outbox[(s, i, s - 1)] = x.grad
                elif a.kind == "weight_grad":
                    self.store.run((s, i))
                elif a.kind == "send":
                    t = outbox.pop((s, i, a.peer)).contiguous()
                    dst = dist.get_global_rank(self.comm.group, sched.stage_rank[a.peer])
                    self.comm.record("send", nbytes(t), nbytes(t), 0)
                    sends.append((dist.isend(t, dst, group=self.comm.group,
                                             tag=tag(s, i, a.peer, sched.n_stages)), t))
                else:  # recv: this one and the next recv_ahead are posted, this one waited for
                    while len(posted) < min(done + 1 + self.recv_ahead, len(self.recvs)):
                        posted.append(self._post_recv(self.recvs[len(posted)], act_shape))
                    work, buf = posted[done]
                    posted[done] = None
                    done += 1
                    work.wait()
                    self.transient.drop(buf)  # the stage's input or output gradient from now on
                    inbox[(s, i, "act" if a.peer < s else "grad")] = buf
        for work, _ in sends:
            work.wait()
        if inbox or outbox or saved or (self.store is not None and self.store.pending()):
            raise RuntimeError(f"rank {self.rank}: the schedule left work undone "
                               f"(inbox {list(inbox)}, outbox {list(outbox)}, saved {list(saved)})")
        return loss_sum
