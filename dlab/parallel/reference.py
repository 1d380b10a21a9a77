"""The two references every other strategy is tested against.

- ``single``: one process, the whole model and the whole global batch. The ground truth.
- ``torch-ddp``: PyTorch's DistributedDataParallel on the same model and global batch; the peer
  dlab's own data-parallel strategies are benchmarked against.
"""
from __future__ import annotations

import time

from torch.nn.parallel import DistributedDataParallel

from dlab.data import shard
from dlab.metrics import ActivationMeter
from dlab.parallel import register
from dlab.parallel.base import BUCKET_CAP_MB, Option, WholeModel, data_parallel_problems


@register("single")
class Single(WholeModel):
    """One process, the whole model and the whole global batch: the ground truth."""
    world_sizes = (1,)

    def setup(self) -> None:
        self.model = self.build_model()
        self.optimizer = self.build_optimizer(self.model.parameters())
        self.meter = ActivationMeter(self.model.parameters())

    def step(self, batch):
        x, y = (t.to(self.ctx.device) for t in batch)
        self.optimizer.zero_grad()
        self.meter.reset_peak()
        loss = self.forward_backward(x, y)
        with self.ctx.timeline.span("optimizer"):
            self.optimizer.step()
        return loss.item()


@register("torch-ddp")
class TorchDDP(WholeModel):
    """PyTorch's DistributedDataParallel, the peer for dlab's data parallelism.

    ``options``: ``bucket_cap_mb`` (PyTorch's default 25); ``comm_hook``: ``"count"`` (default)
    or ``"builtin"``.

    Gradients are views into DDP's buckets (``gradient_as_bucket_view=True``), so the bucket
    memory is the gradient memory and is counted once, under "gradients".

    ``"count"``: a Python comm hook that does what the built-in one does (divide by N,
    all-reduce) counts each bucket's bytes and time and puts its all-reduce on the timeline.
    ``"builtin"``: DDP's own C++ all-reduce, what a user of PyTorch runs and what the benches
    compare against (a Python hook costs a call back into Python per bucket). Its bytes are
    counted from the buckets DDP reports after each step (``bucket_sizes`` in its logging
    data: the buffers it all-reduced, one call each, ring convention); their time is not
    visible from Python, so it is not reported apart from the step, and there are no
    per-bucket events on the timeline.
    """

    OPTIONS = {
        "bucket_cap_mb": BUCKET_CAP_MB,
        "comm_hook": Option("choice", "'count' (a Python hook that counts each bucket and puts it on "
                            "the timeline) or 'builtin' (DDP's own C++ all-reduce)",
                            default="count", choices=("count", "builtin")),
    }

    @classmethod
    def problems(cls, config):
        return super().problems(config) + data_parallel_problems(config, config.world_size)

    def setup(self) -> None:
        self.model = self.build_model()
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(
            self.model, device_ids=device_ids, gradient_as_bucket_view=True,
            bucket_cap_mb=self.ctx.config.options.get("bucket_cap_mb", 25))
        self.builtin = self.ctx.config.options.get("comm_hook", "count") == "builtin"
        if not self.builtin:
            self.ddp.register_comm_hook(self, _counting_allreduce_hook)
        self.optimizer = self.build_optimizer(self.ddp.parameters())
        self.meter = ActivationMeter(self.model.parameters())

    def step(self, batch):
        x, y = (t.to(self.ctx.device) for t in shard(batch, self.ctx.rank, self.ctx.world_size))
        self.optimizer.zero_grad()
        self.meter.reset_peak()
        # DDP's reducer all-reduces buckets as they fill during backward, then waits
        loss = self.forward_backward(x, y, module=self.ddp)
        if self.builtin:
            self._count_builtin_buckets()
        with self.ctx.timeline.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss)

    def _count_builtin_buckets(self) -> None:
        comm, n = self.ctx.comm, self.ctx.comm.size
        sizes = self.ddp._get_ddp_logging_data().get("bucket_sizes", "")
        for size in (int(b) for b in str(sizes).split(",") if b.strip()):
            wire = 2 * (n - 1) / n * size
            comm.record("all_reduce", size, wire, wire)


def _counting_allreduce_hook(strategy, bucket):
    # No annotations: DDP checks them at registration and this module defers annotations.
    comm, tl = strategy.ctx.comm, strategy.ctx.timeline
    start = tl.now()
    work = comm.all_reduce(bucket.buffer().div_(comm.size), async_op=True)

    def finished(fut):
        work.stats.seconds += time.perf_counter() - work.start
        tl.add("all_reduce", start, tl.now(), bucket=bucket.index())
        return fut.value()[0]

    return work.get_future().then(finished)
