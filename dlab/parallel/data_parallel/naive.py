"""``dp-naive``: data parallelism the way one first writes it.

Every rank runs forward and backward on its shard, then all-reduces each parameter's gradient,
one call per tensor, after backward has finished, and divides by N; every replica then takes
the same optimizer step on the same averaged gradient, so the replicas stay identical.

Two costs ``ddp`` removes: communication starts only after the whole backward (nothing
overlaps), and a model of T tensors pays T times the per-message latency (alpha-beta:
T * 2(N-1) alpha on a ring, whatever the bytes). Bytes on the wire are the same as ``ddp``'s:
2 (N-1)/N * P per rank and step for P bytes of gradients (``dlab.theory.data_parallel``).
"""
from __future__ import annotations

from dlab.parallel import register
from dlab.parallel.data_parallel.replica import Replica


@register("dp-naive")
class NaiveDataParallel(Replica):
    """Data parallelism, naive: one blocking all-reduce per gradient tensor after backward."""

    @classmethod
    def replica_zero(cls) -> int:
        return 0

    def step(self, batch):
        x, y = self.my_shard(batch)
        comm, tl = self.ctx.comm, self.ctx.timeline
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.reset_peak()
        loss = self.forward_backward(x, y)
        for i, p in enumerate(self.params):
            start = tl.now()
            comm.all_reduce(p.grad)
            p.grad.div_(comm.size)
            tl.add("all_reduce", start, tl.now(), bucket=i)
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss)
