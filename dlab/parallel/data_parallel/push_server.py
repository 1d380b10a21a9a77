"""What ``ps-backup`` and ``ps-downpour`` share: a parameter server fed by pushes it takes in
the order they land, not in rank order.

Rank 0 serves and is also a worker; it alone holds the optimizer (``ServedReplica``), so
checkpoints are not supported, as for ``ps-sync``. Each worker's push lands in its own inbox. Gloo's receive
handles report completion only when waited for, so a thread per worker waits on that worker's
receive and queues its rank: ``arrivals`` yields the workers in the order their pushes landed.
"""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

from dlab.core.metrics import model_state_memory, storage_bytes
from dlab.parallel.data_parallel.parameter_server import ServedReplica


class PushServer(ServedReplica):
    """Base of the servers that take pushes as they land. A subclass sets ``inbox`` and
    ``outbox`` (server) or ``weights`` and ``push`` (workers) and writes ``_server_step`` and
    ``_worker_step``."""

    def setup(self) -> None:
        super().setup()
        self.workers = range(1, self.ctx.world_size)
        if self.is_server:
            self.arrivals: queue.Queue[int] = queue.Queue()
            self.waiters = ThreadPoolExecutor(max(1, len(self.workers)),
                                              thread_name_prefix=f"dlab-{self.ctx.config.strategy}")

    def _expect_push(self, w: int) -> None:
        work = self.ctx.comm.irecv(self.inbox[w], w)
        self.waiters.submit(lambda: (work.wait(), self.arrivals.put(w)))

    def step(self, batch):
        x, y = self.my_shard(batch)
        self.meter.reset_peak()
        t = self.ctx.timeline.step
        if self.is_server:
            return self._server_step(x, y, t)
        return self._worker_step(x, y, t)

    def memory(self):
        mem = model_state_memory(self.params, self.optimizer)
        mem["activations"] = self.meter.peak
        buffers = ([*self.inbox.values(), *self.outbox.values()] if self.is_server
                   else [self.weights, self.push])
        mem["comm_buffers"] = storage_bytes(buffers)
        return mem
