"""The two references every other strategy is tested against.

- ``single``: one process, the whole model and the whole global batch. The ground truth.
- ``torch-ddp``: PyTorch's DistributedDataParallel on the same model and global batch; the peer
  dlab's own data-parallel strategies are benchmarked against.
"""
from __future__ import annotations

import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from dlab import models
from dlab.core.metrics import ActivationMeter, storage_bytes
from dlab.core.precision import LossScaler
from dlab.models.data import shard
from dlab.parallel import register
from dlab.parallel.base import BUCKET_CAP_MB, Option, WholeModel, data_parallel_problems
from dlab.parallel.data_parallel import compression
from dlab.parallel.mixed import PRECISION, fp32_master, precision_of, refresh, scaled_step
from dlab.runtime import checkpoint, checkpoint_load
from dlab.theory import memory

#: PyTorch's compression hooks, the peers of ``ddp``'s ``compress`` options
CAST_HOOKS = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
HOOKS = (*CAST_HOOKS, "powersgd")


@register("single")
class Single(WholeModel):
    """One process, the whole model and the whole global batch: the ground truth.

    ``precision`` (``dlab.parallel.mixed``): the reference of the distributed strategies' mixed
    precision. The optimizer steps fp32 masters (its own parameters) and the model, cast to the
    compute dtype, is refreshed from them after each step; the loss is taken in fp32 from the
    compute-dtype logits; fp16 scales it (``LossScaler``). One micro-batch: ``bf16-fp32-grads``
    differs from ``bf16`` only in the bytes it holds (the fp32 gradient is kept, the bf16 one
    dropped), not in the numbers."""

    @classmethod
    def replica_zero(cls) -> int:
        return 0

    world_sizes = (1,)
    trains_moe_options = True
    OPTIONS = {"precision": PRECISION}

    @classmethod
    def predicted_state(cls, config, rank):
        """A full replica at the run's precision (``estimate.memory.ddp_memory``)."""
        with torch.device("meta"):
            model = models.build(config.model, config.model_options, config.seed)
        return memory.ddp_memory([p.numel() for p in model.parameters()], config.optimizer,
                                 config.options.get("precision", "fp32"))

    def setup(self) -> None:
        self.model = self.build_model()
        self.prec = precision_of(self.ctx.config)
        self.masters = [fp32_master(p) for p in self.model.parameters()] if self.prec.mixed else []
        self.model.to(self.prec.compute)  # the GPT has no floating-point buffers
        self.optimizer = self.build_optimizer(self.masters or self.model.parameters())
        self.scaler = LossScaler() if self.prec.loss_scaled else None
        self.meter = ActivationMeter(self.model.parameters())

    def step(self, batch):
        if not self.prec.mixed:
            return self._fp32_step(batch)
        x, y = (t.to(self.ctx.device) for t in batch)
        tl = self.ctx.timeline
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.reset_peak()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        with tl.span("forward"), self.meter.track():
            loss = self.model.criterion(self.model(x).float(), y)
        with tl.span("backward"):
            (loss * scale).backward()
        keep_fp32 = self.prec.grad_bytes == 4
        for p, m in zip(self.model.parameters(), self.masters, strict=True):
            m.grad = p.grad.float()
            if keep_fp32:
                p.grad = None
        if scaled_step(self.scaler, [m.grad for m in self.masters]):
            with tl.span("optimizer"):
                self.optimizer.step()
        for p, m in zip(self.model.parameters(), self.masters, strict=True):
            refresh(p, m)
            if not keep_fp32:
                m.grad = None
        return loss.item()

    def _fp32_step(self, batch):
        x, y = (t.to(self.ctx.device) for t in batch)
        self.optimizer.zero_grad()
        self.meter.reset_peak()
        loss = self.forward_backward(x, y)
        with self.ctx.timeline.span("optimizer"):
            self.optimizer.step()
        return loss.item()

    def memory(self):
        """A replica's, with the fp32 masters counted with the optimizer's state and their
        kept fp32 gradients (``bf16-fp32-grads``) with the gradients."""
        mem = super().memory()
        mem["optimizer"] += storage_bytes(self.masters)
        mem["gradients"] += storage_bytes(m.grad for m in self.masters if m.grad is not None)
        return mem

    def checkpoint_state(self):
        """A replica's, the fp32 masters saved as the parameters in mixed precision."""
        return checkpoint.replica_state(self.model, self.optimizer, self.masters)

    def load_checkpoint_state(self, reader):
        """The masters loaded (from a checkpoint of any precision and layout: its parameters
        are fp32), the working copy rounded from them."""
        checkpoint_load.load_replica(self.model, self.optimizer, reader, self.masters)

    def full_state_dict(self):
        """The fp32 masters in mixed precision (the exact values), else the model's own."""
        if not self.masters:
            return super().full_state_dict()
        master = {id(p): m for p, m in zip(self.model.parameters(), self.masters, strict=True)}
        return {k: master[id(v)].detach().cpu().clone()  # a tied matrix under both its names
                for k, v in self.model.state_dict(keep_vars=True).items()}


@register("torch-ddp")
class TorchDDP(WholeModel):
    """PyTorch's DistributedDataParallel, the peer for dlab's data parallelism.

    ``options``: ``bucket_cap_mb`` (PyTorch's default 25); ``comm_hook``: ``"count"`` (default),
    ``"builtin"``, or one of PyTorch's compression hooks, the peers of ``ddp``'s ``compress``:
    ``"fp16"``, ``"bf16"``, ``"powersgd"`` (with ``powersgd_rank`` and ``powersgd_start``).

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

    The compression hooks run unchanged inside a thin counting hook; their collectives go to
    ``torch.distributed`` directly, so their measured wire bytes show as the step's
    ``outside_comm`` and ``sent_bytes`` is the ring model of what each sends:

    - ``"fp16"`` / ``"bf16"`` (``fp16_compress_hook`` / ``bf16_compress_hook``): one all-reduce
      of the bucket in 16 bits. DDP refuses ``bf16_compress_hook`` by name unless torch was
      built with CUDA and NCCL 2.10+, but Gloo sums bf16 (probed, torch 2.13): called from the
      counting hook it runs here too, the same function a GPU user registers.
    - ``"powersgd"`` (``powerSGD_hook`` with a ``PowerSGDState``: rank ``powersgd_rank``,
      ``start_powerSGD_iter=powersgd_start`` (PyTorch requires >= 2), error feedback, warm start,
      ``min_compression_rate`` 2, the run's seed): before the start step, one all-reduce of the
      bucket; after, the elements the state adds to ``total_numel_after_compression`` for the
      bucket (its uncompressed tensors, and (n + m) r per compressed matrix), which the hook
      sends in three all-reduces, counted as one. A compressed bucket is waited for before
      the next one starts (``_counting_powersgd_hook`` says why), so it does not overlap
      backward; dlab's ``powersgd`` runs on its communication thread and does.
    """

    @classmethod
    def replica_zero(cls) -> int:
        return 0

    OPTIONS = {
        "bucket_cap_mb": BUCKET_CAP_MB,
        "comm_hook": Option("choice", "'count' (a Python hook that counts each bucket and puts it on "
                            "the timeline), 'builtin' (DDP's own C++ all-reduce), or PyTorch's "
                            "compression hooks 'fp16', 'bf16', 'powersgd'",
                            default="count", choices=("count", "builtin", *HOOKS)),
        "powersgd_rank": Option("int", "PowerSGDState's matrix_approximation_rank, e.g. 1 to 4",
                                default=compression.POWERSGD_RANK, minimum=1),
        "powersgd_start": Option("int", "PowerSGDState's start_powerSGD_iter: steps of plain "
                                 "all-reduce first, at least 2 with error feedback",
                                 default=compression.POWERSGD_START, minimum=2),
    }

    @classmethod
    def problems(cls, config):
        p = super().problems(config) + data_parallel_problems(config, config.world_size)
        hook = config.options.get("comm_hook", "count")
        p += [f"option {key} applies to comm_hook='powersgd' only (comm_hook={hook!r}); set "
              f"comm_hook='powersgd' or drop {key}"
              for key in ("powersgd_rank", "powersgd_start") if key in config.options and hook != "powersgd"]
        return p

    def setup(self) -> None:
        self.model = self.build_model()
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(
            self.model, device_ids=device_ids, gradient_as_bucket_view=True,
            bucket_cap_mb=self.ctx.config.options.get("bucket_cap_mb", 25))
        options = self.ctx.config.options
        hook = options.get("comm_hook", "count")
        self.builtin = hook == "builtin"
        if hook == "count":
            self.ddp.register_comm_hook(self, _counting_allreduce_hook)
        elif hook in CAST_HOOKS:
            self.cast_hook = CAST_HOOKS[hook]
            self.ddp.register_comm_hook(self, _counting_cast_hook)
        elif hook == "powersgd":
            self.powersgd = PowerSGDState(
                None, matrix_approximation_rank=options.get("powersgd_rank", compression.POWERSGD_RANK),
                start_powerSGD_iter=options.get("powersgd_start", compression.POWERSGD_START),
                min_compression_rate=compression.MIN_COMPRESSION_RATE, use_error_feedback=True,
                warm_start=True, random_seed=self.ctx.config.seed)
            self.ddp.register_comm_hook(self, _counting_powersgd_hook)
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
        comm.spent(work.stats, work.start)
        tl.add("all_reduce", start, tl.now(), bucket=bucket.index())
        return fut.value()[0]

    return work.get_future().then(finished)


def _counted(strategy, bucket, fut, payload: int):
    """Record one all-reduce of ``payload`` bytes (ring model) for a bucket that PyTorch's hook
    sends itself, timed to its future's completion, and put it on the timeline."""
    comm, tl = strategy.ctx.comm, strategy.ctx.timeline
    n, start, begin = comm.size, tl.now(), time.perf_counter()
    wire = 2 * (n - 1) / n * payload
    stats = comm.record("all_reduce", payload, wire, wire)

    def finished(f):
        comm.spent(stats, begin)
        tl.add("all_reduce", start, tl.now(), bucket=bucket.index())
        return f.value()

    return fut.then(finished)


def _counting_cast_hook(strategy, bucket):
    payload = 2 * bucket.buffer().numel()  # 16 bits an element
    return _counted(strategy, bucket, strategy.cast_hook(None, bucket), payload)


def _counting_powersgd_hook(strategy, bucket):
    state, buffer = strategy.powersgd, bucket.buffer()
    compressing = state.iter >= state.start_powerSGD_iter
    before = state.total_numel_after_compression
    fut = powerSGD_hook(state, bucket)  # adds the bucket's elements sent to the state, now
    numel = state.total_numel_after_compression - before if compressing else buffer.numel()
    if compressing:
        # The hook issues a bucket's P and Q all-reduces from the completion callback of its
        # first one, racing the next bucket's first all-reduce issued by autograd: ranks then
        # issue collectives in different orders and Gloo aborts ("Received data size doesn't
        # match expected size", seen here at 2 ranks with 7 buckets). Waiting for the bucket
        # makes them one at a time, in order, at the price of their overlap with backward.
        fut.wait()
    return _counted(strategy, bucket, fut, numel * buffer.element_size())
