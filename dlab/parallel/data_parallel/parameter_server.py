"""``ps-sync`` and ``ps-async``: data parallelism through a parameter server (Li et al.,
"Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014; Dean et al.,
"Large Scale Distributed Deep Networks" (DistBelief / Downpour SGD), NIPS 2012).

Layout: rank 0 is the server *and* a worker (it computes the gradient of its own shard too);
ranks 1..N-1 are workers. The server alone holds the optimizer state; workers hold weights and
gradients only. Per step, with P the bytes of the parameters (fp32):

    worker  pushes its gradient (P bytes) and pulls the new weights (P bytes):   2 P
    server  receives N-1 gradients and sends N-1 copies of the weights:   2 (N-1) P

Every worker moves twice the weights, whatever N, but the server's link carries N-1 times a
worker's traffic and the server is also the only rank that runs the optimizer: it is the
bottleneck, which is why all-reduce (every rank sends 2 (N-1)/N P, spread evenly) replaced it
for dense models. The messages are plain ``send`` / ``recv`` through the counting ``Comm``, so
the figures above are what the metrics show (``dlab.theory.data_parallel.ps_bytes``).

``ps-sync``: the server waits for every gradient, averages them (its own included), steps, and
sends the new weights back; identical to ``single`` on the global batch, up to float order.

``ps-async``: see ``AsyncParameterServer``.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from dlab.core.metrics import ActivationMeter, model_state_memory, storage_bytes
from dlab.parallel import register
from dlab.parallel.base import Option, Strategy
from dlab.parallel.data_parallel.replica import Replica

SERVER = 0


@torch.no_grad()
def copy_flat_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors``. (``vector_to_parameters`` would
    make them *views* of ``flat``, and the next message into that buffer would rewrite them.)"""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class ServedReplica(Replica):
    """A replica on every rank, the optimizer on rank 0 (the server) alone: every parameter
    server here."""

    # Only the server holds the optimizer: a checkpoint would be the server's alone (not done).
    replicated = False
    checkpoint_state = Strategy.checkpoint_state
    load_checkpoint_state = Strategy.load_checkpoint_state

    @classmethod
    def predicted_state(cls, config, rank):
        """No formula: the server holds the optimizer, the workers none."""
        return None

    def setup(self) -> None:
        self.model = self.build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.is_server = self.ctx.rank == SERVER
        self.optimizer = self.build_optimizer(self.params) if self.is_server else None
        self.meter = ActivationMeter(self.params)


@register("ps-sync")
class SyncParameterServer(ServedReplica):
    """Parameter server (rank 0 serves and works): push gradients, wait for all, pull weights."""

    def setup(self) -> None:
        super().setup()
        n = sum(p.numel() for p in self.params)
        like = dict(dtype=self.params[0].dtype, device=self.ctx.device)
        # Server: one receive buffer per worker, so all pushes can land at once; workers: the
        # flat gradient they push and the flat weights they pull.
        workers = self.ctx.world_size - 1 if self.is_server else 0
        self.inbox = [torch.zeros(n, **like) for _ in range(workers)]
        self.outbox = torch.zeros(n, **like)

    def _zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _flat_grad(self) -> torch.Tensor:
        return parameters_to_vector([p.grad for p in self.params])

    def _server_update(self, own: torch.Tensor) -> None:
        """Receive every worker's gradient, average with the server's own, step."""
        comm, tl = self.ctx.comm, self.ctx.timeline
        with tl.span("recv", what="grads"):
            works = [comm.irecv(buf, w) for w, buf in enumerate(self.inbox, start=1)]
            for work in works:
                work.wait()
        total = own
        for buf in self.inbox:
            total = total + buf
        copy_flat_into(total / self.ctx.world_size, [p.grad for p in self.params])
        with tl.span("optimizer"):
            self.optimizer.step()

    def step(self, batch):
        x, y = self.my_shard(batch)
        comm, tl = self.ctx.comm, self.ctx.timeline
        self._zero_grad()
        self.meter.reset_peak()
        loss = self.forward_backward(x, y)
        if self.is_server:
            self._server_update(self._flat_grad())
            self.outbox.copy_(parameters_to_vector(self.params))
            with tl.span("send", what="weights"):
                for work in [comm.isend(self.outbox, w) for w in range(1, self.ctx.world_size)]:
                    work.wait()
        else:
            self.outbox.copy_(self._flat_grad())
            with tl.span("send", what="grads"):
                comm.send(self.outbox, SERVER)
            with tl.span("recv", what="weights"):
                comm.recv(self.outbox, SERVER)
            copy_flat_into(self.outbox, self.params)
        return self.mean_loss(loss)

    def memory(self):
        mem = model_state_memory(self.params, self.optimizer)
        mem["activations"] = self.meter.peak
        mem["comm_buffers"] = storage_bytes([*self.inbox, self.outbox])
        return mem


@register("ps-async")
class AsyncParameterServer(SyncParameterServer):
    """Parameter server with asynchronous pulls: workers compute on the newest weights that
    have arrived, up to ``max_staleness`` rounds old (option; default None: unbounded).

    How it runs. The server (rank 0, also a worker) applies one update per round r, the average
    of the round's N gradients, exactly as ``ps-sync`` does, and pushes the weights of version
    r+1 to every worker without waiting for them to be taken. A worker does not wait for them
    either: a thread receives each new version in the background, and at the start of round r
    the worker takes the newest version v it has. Its gradient for round r is then computed on
    weights r - v updates old: that is the *staleness*, recorded on each ``forward`` event of
    the timeline (``staleness=...``). With ``max_staleness = s`` a worker that would be more
    than s rounds behind waits for version r - s first (Stale Synchronous Parallel, Ho et al.
    NIPS 2013; "bounded delay" in Li et al. 2014); s = 0 is exactly ``ps-sync``.

    The gradient of a stale replica points downhill from where the weights *were*; the server
    applies it where they are now. Small staleness costs little (Zhang et al. 2016 scale the
    step by 1/staleness to compensate); a large one slows or breaks convergence. Here the
    loop's per-step loss average is a barrier, so a worker can run at most about one round
    ahead of the server, and most of the staleness is 0 or 1; on a cluster with uneven workers
    it grows with the spread of their speeds.

    Losses do not match ``single`` (they are not meant to) unless ``max_staleness=0``.
    Bytes per round are ``ps-sync``'s; a worker's pulls are counted in the step that takes
    them, so the per-step figures vary and their sum over the run is the formula's. The
    seconds of a non-blocking push run from its launch to the wait a round later, so they
    overstate the time it cost; the ``recv`` events on the timeline show what actually blocked.
    """

    @classmethod
    def check_options(cls) -> dict:
        return {"max_staleness": 0}  # unbounded staleness differs from single by design

    OPTIONS = {"max_staleness": Option("int", "rounds a worker may run ahead of the server; "
                                       "None is unbounded, 0 makes ps-async behave as ps-sync",
                                       minimum=0, none_ok=True)}

    def setup(self) -> None:
        super().setup()
        self.max_staleness = self.ctx.config.options.get("max_staleness")
        self.version = 0  # how many server updates the weights on this rank have seen
        self.sends: list = []
        self.puller: threading.Thread | None = None
        self.arrived = threading.Condition()
        self.newest: tuple[int, torch.Tensor, float] | None = None  # version, buffer, arrival
        # Two pull buffers alternate, so one can be copied while the next version arrives.
        self.pulls = [] if self.is_server else [torch.zeros_like(self.outbox) for _ in range(2)]
        self.ctx.comm.stats["recv"]  # noqa: B018 - the key exists before the thread runs

    def memory(self):
        mem = super().memory()
        mem["comm_buffers"] += storage_bytes(self.pulls)
        return mem

    # --- worker side ------------------------------------------------------------------------
    def _pull_loop(self, first: int, last: int) -> None:
        """Receive versions ``first..last`` as the server sends them (a background thread).
        It never overwrites the buffer that holds a version the main thread has not taken."""
        for v in range(first, last + 1):
            buf = self.pulls[v % 2]
            with self.arrived:
                self.arrived.wait_for(lambda b=buf: self.newest is None or self.newest[1] is not b)
            dist.recv(buf, SERVER, group=self.ctx.comm.group)
            with self.arrived:
                self.newest = (v, buf, self.ctx.timeline.now())
                self.arrived.notify_all()

    def _take_newest(self, required: int | None) -> None:
        """Adopt the newest weights received, first waiting until they are at least version
        ``required`` (the staleness bound; None: never wait)."""
        comm, tl = self.ctx.comm, self.ctx.timeline
        start, t0 = tl.now(), time.perf_counter()
        with self.arrived:
            self.arrived.wait_for(lambda: required is None or self.version >= required or (
                self.newest is not None and self.newest[0] >= required))
            if self.newest is None or self.newest[0] <= self.version:
                return
            version, buf, arrival = self.newest
            copy_flat_into(buf, self.params)
            self.newest = None
            self.arrived.notify_all()
        # The thread received every version in between; count each one's bytes, the time this
        # step waited for them once.
        size = buf.numel() * buf.element_size()
        waited = time.perf_counter() - t0
        for i in range(version - self.version):
            comm.record("recv", size, 0, size, seconds=waited if i == 0 else 0.0)
        tl.add("recv", min(arrival, start), tl.now(), what="weights", version=version)
        self.version = version

    def step(self, batch):
        x, y = self.my_shard(batch)
        comm, tl = self.ctx.comm, self.ctx.timeline
        r, steps = tl.step, self.ctx.config.steps
        self.meter.reset_peak()
        if not self.is_server:
            if self.puller is None:
                self.version = r
                self.puller = threading.Thread(target=self._pull_loop, args=(r + 1, steps),
                                               daemon=True, name="dlab-ps-pull")
                self.puller.start()
            s = self.max_staleness
            self._take_newest(None if s is None else r - s)
            self._zero_grad()
            loss = self.forward_backward(x, y, staleness=r - self.version)
            for work in self.sends:
                work.wait()
            self.outbox.copy_(self._flat_grad())
            self.sends = [comm.isend(self.outbox, SERVER)]  # push, and go on
            mean = self.mean_loss(loss)
            if r == steps - 1:  # the run ends with every replica on the final weights
                self._take_newest(steps)
                self.puller.join()
                self.sends.pop().wait()
            return mean
        for work in self.sends:  # the previous version must be out before outbox is rewritten
            work.wait()
        self._zero_grad()
        loss = self.forward_backward(x, y, staleness=0)
        # The loss average is the one barrier of a round; the server takes it before waiting
        # for the gradients, so the workers go on to the next round while it updates.
        mean = self.mean_loss(loss)
        self._server_update(self._flat_grad())
        self.version += 1
        self.outbox.copy_(parameters_to_vector(self.params))
        self.sends = [comm.isend(self.outbox, w) for w in range(1, self.ctx.world_size)]
        if r == steps - 1:
            for work in self.sends:
                work.wait()
            self.sends = []
        return mean
