"""``ps-downpour``: a parameter server that applies each gradient the moment it lands (Dean et
al., "Large Scale Distributed Deep Networks", NIPS 2012: Downpour SGD, with one server shard).

``ps-async`` lets workers compute on stale weights but still averages whole rounds, so a round
ends with the slowest push and a straggler sets everyone's pace. Here there are no rounds: the
server steps its optimizer once per gradient, with that gradient divided by N (one shard of the
global batch), and answers the pushing worker at once with the newest weights. A fast worker
never waits for a slow one; what it pays instead is *staleness*: its gradient was computed on
weights of version v and is applied to version V >= v (V - v updates happened in between).

Layout and messages follow ``ps-backup``: rank 0 serves and is also a worker; it holds the
optimizer. Each step, rank 0 computes its own gradient and applies it, then serves every push
that has arrived (without waiting for any); a worker computes, pushes (gradient, step, the
version it computed on, its loss) and receives the weights of the server's answer. A push
that lands while the server computes is answered after that computation: the server's own
step is the longest a worker waits. The run ends when every gradient has been applied: at its
last step the server serves pushes until every worker has pushed its last, and answers each
last push with the final weights, so every replica ends equal. The fast ranks' steps stay
short; what the straggler costs them is the wait at the very end, for its remaining steps,
and the staleness of its gradients (its first lands after the others' whole run here).

The update is not ``single``'s (each step applies N separate gradients, most on older
weights), so it is tested against its own rule: rank 0's metrics list every gradient applied
(``downpour.applied``: rank, step, version computed on, staleness), in order, and the tests
replay them in one process. The logged loss is each rank's own; no collective is taken per
step (one would wait for the straggler). Checkpoints are not supported (the optimizer lives on
the server alone, as for ``ps-sync``).
"""
from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector

from dlab.parallel import register
from dlab.parallel.data_parallel.parameter_server import SERVER, copy_flat_into
from dlab.parallel.data_parallel.push_server import PushServer

#: a push carries, after the gradient: its step, the version it was computed on, its loss
EXTRA = 3


@register("ps-downpour")
class DownpourServer(PushServer):
    """Parameter server that steps on each gradient as it arrives (Dean et al. 2012)."""

    differs_from_single = ("it steps on each gradient alone, on stale weights: not single's update "
                           "by design (tests/test_downpour.py replays its own rule)")

    def setup(self) -> None:
        super().setup()
        n = sum(p.numel() for p in self.params)
        like = dict(dtype=self.params[0].dtype, device=self.ctx.device)
        self.version = 0  # server: updates applied; worker: the version of its weights
        if self.is_server:
            self.inbox = {w: torch.zeros(n + EXTRA, **like) for w in self.workers}
            self.outbox = {w: torch.zeros(n + 1, **like) for w in self.workers}
            self.sends: dict[int, object] = {}
            self.last_pushed = dict.fromkeys(self.workers, -1)
            for w in self.workers:
                self._expect_push(w)
            self.applied: list[list[int]] = []
        else:
            self.weights = torch.zeros(n + 1, **like)  # the weights and their version
            self.push = torch.zeros(n + EXTRA, **like)

    # --- the server ---------------------------------------------------------------------------
    def _apply(self, grad: torch.Tensor, rank: int, step: int, computed_on: int) -> None:
        copy_flat_into(grad / self.ctx.world_size, [p.grad for p in self.params])
        with self.ctx.timeline.span("optimizer"):
            self.optimizer.step()
        self.applied.append([rank, step, computed_on, self.version - computed_on])
        self.version += 1

    def _answer(self, w: int) -> None:
        if w in self.sends:
            self.sends.pop(w).wait()
        out = self.outbox[w]
        out[:-1].copy_(parameters_to_vector(self.params))
        out[-1] = self.version
        self.sends[w] = self.ctx.comm.isend(out, w)

    def _serve(self, w: int) -> None:
        """Apply worker ``w``'s push and answer it, unless it was its last (the final weights
        answer that one)."""
        box = self.inbox[w]
        step = int(box[-3])
        self._apply(box[:-EXTRA], w, step, int(box[-2]))
        self.last_pushed[w] = step
        if step < self.ctx.config.steps - 1:
            self._expect_push(w)
            self._answer(w)

    def _server_step(self, x, y, t: int) -> float:
        for p in self.params:
            p.grad = None
        loss = self.forward_backward(x, y, staleness=0).item()
        self._apply(parameters_to_vector([p.grad for p in self.params]), SERVER, t, self.version)
        last = self.ctx.config.steps - 1
        with self.ctx.timeline.span("recv", what="grads"):
            while not self.arrivals.empty():  # every push that has landed, none awaited
                self._serve(self.arrivals.get())
            while t == last and any(s < last for s in self.last_pushed.values()):
                self._serve(self.arrivals.get(timeout=self.ctx.config.timeout_s))
        if t == last:
            for w in self.last_pushed:
                self._answer(w)
            for work in self.sends.values():
                work.wait()
            self.waiters.shutdown()
        return loss

    # --- a worker -------------------------------------------------------------------------------
    def _worker_step(self, x, y, t: int) -> float:
        comm, tl = self.ctx.comm, self.ctx.timeline
        for p in self.params:
            p.grad = None
        loss = self.forward_backward(x, y).item()
        self.push[:-EXTRA].copy_(parameters_to_vector([p.grad for p in self.params]))
        self.push[-3], self.push[-2], self.push[-1] = t, self.version, loss
        comm.send(self.push, SERVER)
        with tl.span("recv", what="weights"):
            comm.recv(self.weights, SERVER)
        copy_flat_into(self.weights[:-1], self.params)
        self.version = int(self.weights[-1])
        return loss

    def step_extras(self) -> dict:
        if not self.is_server:
            return {"downpour": {"version": self.version}}
        applied, self.applied = self.applied, []
        return {"downpour": {"applied": applied}}
