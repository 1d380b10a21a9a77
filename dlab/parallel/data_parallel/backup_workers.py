"""``ps-backup``: synchronous SGD with backup workers (Chen, Pan, Monga, Bengio, Jozefowicz,
"Revisiting Distributed Synchronous SGD", 2016).

Synchronous data parallelism runs at the pace of its slowest rank: every step waits for every
gradient. Asynchronous SGD does not wait, and pays in stale gradients (``ps-async``). Chen et
al. keep the update synchronous and drop the stragglers instead: with N workers of which b are
*backups*, the server averages the first N - b gradients of the step to arrive, steps, and
discards the b late ones. Every gradient used was computed on the current weights, so there is
no staleness; the price is that each update averages N - b shards of the batch instead of N.

Layout and messages follow ``ps-sync`` (rank 0 serves and is also a worker; it holds the
optimizer). The option ``backup`` is b.

Server, step t (weights of version t):

1. compute its own gradient on its shard of batch t: the first arrival, as it needs no network;
2. poll the workers' pending pushes until N - b gradients of version t are in; a push of an
   older version (a straggler from an earlier step) is dropped, and that worker is sent the
   current weights at once, so it joins the step in progress;
3. average the gradients used, step, and send version t+1 to the workers it used. A worker it
   did not use is still computing; it gets the newest weights when its late push lands.

A worker: receive weights (they carry their version v), and in the loop's step t compute and
push only if v == t; a worker that was late receives a version ahead of its step and skips the
steps in between (its gradient for them would come too late to count anyway). At the last
step the server waits for every pending push and sends the final weights to all, so every
replica ends equal.

Messages carry one extra number each: the version on the weights, the version and the local
loss on a gradient. So a rank moves (P + 4) bytes per message, not P. The logged loss of a step
is the server's mean over the shards it used; no collective is taken per step (the loop's usual
mean-loss all-reduce would wait for the straggler and undo the point). rank 0's metrics name the
ranks used in each step (``backup.used``), so tests check the update against its own rule.
"""
from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector

from dlab.parallel import register
from dlab.parallel.base import Option
from dlab.parallel.data_parallel.parameter_server import SERVER, copy_flat_into
from dlab.parallel.data_parallel.push_server import PushServer


@register("ps-backup")
class BackupWorkers(PushServer):
    """Parameter server that averages the first N - b gradients of each step (Chen et al. 2016)."""

    @classmethod
    def check_options(cls) -> dict:
        return {"backup": 0}  # dropping gradients differs from single by design; b = 0 is ps-sync

    OPTIONS = {"backup": Option("int", "b: how many of the N ranks' gradients the server may "
                                "leave out of each step (it uses the first N - b to arrive)",
                                default=1, minimum=0)}

    @classmethod
    def problems(cls, config):
        p = super().problems(config)
        b = config.options.get("backup", 1)
        if not p and b >= config.world_size:
            p.append(f"backup={b} leaves no gradient to use at world_size={config.world_size}; "
                     f"use backup < world_size (Chen et al. use about N/20)")
        return p

    def setup(self) -> None:
        super().setup()
        self.backup = self.ctx.config.options.get("backup", 1)
        n = sum(p.numel() for p in self.params)
        like = dict(dtype=self.params[0].dtype, device=self.ctx.device)
        if self.is_server:
            # per worker: the buffer its push lands in, the weights sent to it (an isend must
            # keep its buffer), the pending receive, the version it was last sent
            self.inbox = {w: torch.zeros(n + 2, **like) for w in self.workers}
            self.outbox = {w: torch.zeros(n + 1, **like) for w in self.workers}
            self.sends: dict[int, object] = {}
            self.pending: set[int] = set()
            for w in self.workers:
                self._expect_push(w)
            self.sent_version = dict.fromkeys(self.workers, 0)  # every replica starts at version 0
            self.used: list[int] = []
        else:
            self.weights = torch.zeros(n + 1, **like)
            self.push = torch.zeros(n + 2, **like)
            self.push_work = None
            self.version, self.need_weights = 0, False
            self.last_loss = float("nan")

    # --- the server ---------------------------------------------------------------------------
    def _send_weights(self, w: int, version: int) -> None:
        if w in self.sends:
            self.sends.pop(w).wait()
        out = self.outbox[w]
        out[:-1].copy_(parameters_to_vector(self.params))
        out[-1] = version
        self.sends[w] = self.ctx.comm.isend(out, w)
        self.sent_version[w] = version
        if version < self.ctx.config.steps:  # the final weights ask for no gradient back
            self._expect_push(w)

    def _expect_push(self, w: int) -> None:
        super()._expect_push(w)
        self.pending.add(w)

    def _next_arrival(self) -> int:
        w = self.arrivals.get(timeout=self.ctx.config.timeout_s)
        self.pending.discard(w)
        return w

    def _server_step(self, x, y, t: int) -> float:
        tl = self.ctx.timeline
        for p in self.params:
            p.grad = None
        loss = self.forward_backward(x, y).item()
        total = parameters_to_vector([p.grad for p in self.params])
        used, losses = [SERVER], [loss]
        need = self.ctx.world_size - self.backup
        with tl.span("recv", what="grads"):
            while len(used) < need:
                w = self._next_arrival()
                if int(self.inbox[w][-2]) == t:
                    total += self.inbox[w][:-2]
                    used.append(w)
                    losses.append(self.inbox[w][-1].item())
                else:  # a straggler's push from an earlier step: dropped, and it rejoins now
                    self._send_weights(w, t)
        copy_flat_into(total / len(used), [p.grad for p in self.params])
        with tl.span("optimizer"):
            self.optimizer.step()
        self.used = sorted(used)
        for w in self.used[1:]:
            self._send_weights(w, t + 1)
        if t == self.ctx.config.steps - 1:
            self._finish(t + 1)
        return sum(losses) / len(losses)

    def _finish(self, final: int) -> None:
        """Wait for every push still pending, then give every replica the final weights."""
        while self.pending:
            self._send_weights(self._next_arrival(), final)
        for work in self.sends.values():
            work.wait()
        self.waiters.shutdown()

    # --- a worker -------------------------------------------------------------------------------
    def _worker_step(self, x, y, t: int) -> float:
        comm, tl = self.ctx.comm, self.ctx.timeline
        if self.need_weights:
            with tl.span("recv", what="weights"):
                comm.recv(self.weights, SERVER)
            copy_flat_into(self.weights[:-1], self.params)
            self.version, self.need_weights = int(self.weights[-1]), False
        if self.version == t:
            for p in self.params:
                p.grad = None
            self.last_loss = self.forward_backward(x, y).item()
            if self.push_work is not None:
                self.push_work.wait()
            self.push[:-2].copy_(parameters_to_vector([p.grad for p in self.params]))
            self.push[-2], self.push[-1] = t, self.last_loss
            self.push_work = comm.isend(self.push, SERVER)
            self.need_weights = True
        if t == self.ctx.config.steps - 1:  # the run ends with every replica on the final weights
            if self.need_weights:
                with tl.span("recv", what="weights"):
                    comm.recv(self.weights, SERVER)
                copy_flat_into(self.weights[:-1], self.params)
            if self.push_work is not None:
                self.push_work.wait()
        return self.last_loss

    def step_extras(self) -> dict:
        return {"backup": {"used": self.used}} if self.is_server else {
            "backup": {"version": self.version}}
