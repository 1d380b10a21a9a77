"""``ddp``: data parallelism with gradient buckets whose all-reduce overlaps backward.

The design of PyTorch's DistributedDataParallel (Li et al., "PyTorch Distributed: Experiences
on Accelerating Data Parallel Training", VLDB 2020), written out:

1. Gradients live in flat buckets of at most ``bucket_cap_mb`` (``buckets.py``); each
   parameter's ``.grad`` is a view into its bucket.
2. ``register_post_accumulate_grad_hook`` fires when a parameter's gradient is final for this
   backward. When the last gradient of a bucket arrives, the bucket is divided by N and its
   all-reduce is started *asynchronously*; autograd meanwhile computes the earlier layers'
   gradients, so communication hides behind computation. Buckets are launched strictly in index
   order (a ready bucket waits for the ones before it) because collectives must be issued in
   the same order on every rank.
3. After backward, wait for the outstanding all-reduces; the optimizer then steps on averaged
   gradients that are identical on every replica.
4. ``no_sync()``: gradient accumulation over k micro-batches communicates only on the last
   one; the inner ones just accumulate into the buckets (option ``accumulation: k``).

``options``: ``bucket_cap_mb`` (default 25, PyTorch's), ``accumulation`` (micro-batches per
step, default 1), ``allreduce``: ``"backend"`` (``torch.distributed.all_reduce``, default) or
``"ring"`` (dlab's hand-written ring from ``dlab.comm.algorithms``, run on a communication
thread so it still overlaps backward).

Gradient compression (``compression.py``), ``compress``: ``"none"`` (default), ``"fp16"`` or
``"bf16"`` (all-reduce in 16 bits, PyTorch's ``fp16_compress_hook``), ``"powersgd"`` (rank
``powersgd_rank``, default 1, after ``powersgd_start`` steps of plain all-reduce, default 2;
Vogels et al. 2019) or ``"topk"`` (the ``topk_ratio`` largest entries of each bucket, default
0.01, all-gathered; Stich et al. 2018). A compressed bucket is reduced on the same one-thread
communication pool as the ring, started from the same hooks, so it overlaps backward too. The
compressors' error feedback and warm start live on each rank apart from the model and are not
in checkpoints, so a stateful compressor (powersgd, topk) is refused with checkpoints.

Not done here, and what it would buy: PyTorch also re-orders buckets after the first iteration
to the order gradients actually became ready, and finds unused parameters on request; the
models here use every parameter, and a bucket never marked ready is flushed after backward.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

from dlab.comm.algorithms import ALGORITHMS
from dlab.parallel import register
from dlab.parallel.base import BUCKET_CAP_MB, Option
from dlab.parallel.data_parallel import compression
from dlab.parallel.data_parallel.buckets import build_buckets
from dlab.parallel.data_parallel.replica import Replica

MiB = 2 ** 20
ALLREDUCE = ("backend", "ring")


def ddp_options(config) -> tuple[float, int, str]:
    o = config.options
    return (o.get("bucket_cap_mb", 25), o.get("accumulation", 1), o.get("allreduce", "backend"))


@register("ddp")
class DistributedDataParallel(Replica):
    """Data parallelism with buckets all-reduced from autograd hooks, overlapping backward."""

    @classmethod
    def replica_zero(cls) -> int:
        return 0

    OPTIONS = {
        "bucket_cap_mb": BUCKET_CAP_MB,
        "accumulation": Option("int", "micro-batches per step (gradient accumulation)", default=1,
                               minimum=1),
        "allreduce": Option("choice", "torch.distributed.all_reduce ('backend') or dlab's ring",
                            default="backend", choices=ALLREDUCE),
        "compress": Option("choice", "gradient compression per bucket: 'none', 'fp16' or 'bf16' (a "
                           "16-bit all-reduce), 'powersgd' (low rank) or 'topk' (sparse)",
                           default="none", choices=compression.METHODS),
        "powersgd_rank": Option("int", "PowerSGD's rank r per matrix, e.g. 1 to 4",
                                default=compression.POWERSGD_RANK, minimum=1),
        "powersgd_start": Option("int", "steps of plain all-reduce before PowerSGD compresses "
                                 "(PyTorch's start_powerSGD_iter)",
                                 default=compression.POWERSGD_START, minimum=0),
        "topk_ratio": Option("number", "the fraction of each bucket's entries top-k sends, in (0, 1], "
                             "e.g. 0.01", default=compression.TOPK_RATIO, minimum=0, above=True),
    }
    #: the options that only mean something with one compressor
    COMPRESS_OPTIONS = {"powersgd_rank": "powersgd", "powersgd_start": "powersgd", "topk_ratio": "topk"}

    @classmethod
    def problems(cls, config):
        p = super().problems(config)
        if p:
            return p
        _, k, allreduce = ddp_options(config)
        p += compress_problems(config, allreduce)
        if not p and config.batch_size % (config.world_size * k):
            p.append(f"the global batch_size={config.batch_size} does not split into "
                     f"{config.world_size} ranks x {k} micro-batches of equal size; use a "
                     f"multiple of {config.world_size * k} (or fewer accumulation steps)")
        return p

    def setup(self) -> None:
        super().setup()
        cap_mb, self.accumulation, self.allreduce = ddp_options(self.ctx.config)
        self.buckets = build_buckets(self.params, max(1, int(cap_mb * MiB)))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        # A single thread keeps the ring's point-to-point messages, or a compressor's
        # collectives, in bucket order.
        self.ring = ALGORITHMS["ring"] if self.allreduce == "ring" else None
        self.compressor = compression.make(self.ctx.config, self.ctx.comm, self.buckets, self.params)
        threaded = self.ring is not None or self.compressor is not None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dlab-comm") if threaded else None
        self.sync = True
        # create the op's key before any thread counts
        self.ctx.comm.stats[self.compressor.op if self.compressor else "all_reduce"]  # noqa: B018
        self._start_iteration()

    # --- gradient accumulation ------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into the buckets; the next one outside
        all-reduces the sum (PyTorch's ``DistributedDataParallel.no_sync``)."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    # --- hooks and launches -----------------------------------------------------------------
    def _start_iteration(self) -> None:
        for b in self.buckets:
            b.reset()
        self.next_bucket = 0
        self.in_flight = []

    def _grad_ready(self, param) -> None:
        if not self.sync:
            return
        self.bucket_of[id(param)].pending.discard(id(param))
        while self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket].pending:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket) -> None:
        comm, tl = self.ctx.comm, self.ctx.timeline
        start = tl.now()
        if self.compressor is not None:
            self.in_flight.append(self.pool.submit(self._compressed_reduce, bucket, start))
            return
        bucket.flat.div_(comm.size)  # average as a sum of g_i / N, as PyTorch does
        if self.ring is not None:
            self.in_flight.append(self.pool.submit(self._ring_all_reduce, bucket, start))
            return
        work = comm.all_reduce(bucket.flat, async_op=True)

        def finished(fut):
            # Timed at completion (not at the wait after backward) so the seconds and the
            # timeline show when the bytes actually moved.
            comm.spent(work.stats, work.start)
            tl.add("all_reduce", start, tl.now(), bucket=bucket.index)
            return fut.value()

        self.in_flight.append(work.get_future().then(finished))

    def _ring_all_reduce(self, bucket, start: float) -> None:
        comm, tl = self.ctx.comm, self.ctx.timeline
        begin = time.perf_counter()
        report = self.ring(bucket.flat, group=comm.group, op="sum")
        sent, recv = _report_bytes(report, bucket.nbytes, comm.size)
        comm.spent(comm.record("all_reduce", bucket.nbytes, sent, recv), begin)  # behind backward
        tl.add("all_reduce", start, tl.now(), bucket=bucket.index, algorithm="ring")

    def _compressed_reduce(self, bucket, start: float) -> None:
        tl = self.ctx.timeline
        self.compressor.reduce(bucket)
        tl.add(self.compressor.op, start, tl.now(), bucket=bucket.index, compress=self.compressor.name)

    def _finish_iteration(self) -> None:
        # A bucket whose hook never fired (a parameter unused in this forward) still has to be
        # reduced, in order, or the ranks' collectives would not match.
        while self.next_bucket < len(self.buckets):
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1
        for fut in self.in_flight:
            fut.result() if self.pool is not None else fut.wait()
        self._start_iteration()

    def memory(self):
        mem = super().memory()
        if self.compressor is not None:  # error feedback, warm start: held for the next step
            mem["comm_buffers"] += self.compressor.state_bytes()
        return mem

    # --- the step ---------------------------------------------------------------------------
    def step(self, batch):
        x, y = self.my_shard(batch)
        k, tl = self.accumulation, self.ctx.timeline
        for b in self.buckets:
            b.flat.zero_()  # the .grad views see it; zero_grad(set_to_none) would break them
        self.meter.reset_peak()
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
            inner = self.no_sync() if i < k - 1 else contextlib.nullcontext()
            with inner:
                total = total + self.forward_backward(xm, ym, scale=1.0 / k, mb=i)
        with tl.span("comm_wait"):
            self._finish_iteration()
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(total / k)


def compress_problems(config, allreduce: str) -> list[str]:
    """What cannot work in the compression options, each with what to change."""
    o, p = config.options, []
    method = o.get("compress", "none")
    for key, needs in DistributedDataParallel.COMPRESS_OPTIONS.items():
        if key in o and method != needs:
            p.append(f"option {key} applies to compress='{needs}' only (compress={method!r}); "
                     f"set compress='{needs}' or drop {key}")
    if o.get("topk_ratio", compression.TOPK_RATIO) > 1:
        p.append(f"option topk_ratio={o['topk_ratio']!r} is the fraction of entries sent, so at "
                 f"most 1; use e.g. 0.01 (1 %)")
    if method != "none" and allreduce == "ring":
        p.append(f"compress={method!r} runs its own collectives on the backend; use "
                 f"allreduce='backend' (the default) with it")
    if method in ("powersgd", "topk") and (config.checkpoint_every or config.resume):
        p.append(f"compress={method!r} keeps error feedback on each rank that checkpoints do not "
                 f"hold, so a resumed run would not continue the same training; set "
                 f"checkpoint_every=0 and resume='', or use compress='fp16' / 'bf16' (no state)")
    return p


def _report_bytes(report, nbytes: int, n: int) -> tuple[float, float]:
    """Bytes the hand-written ring says it sent and received; its Report carries them."""
    sent = getattr(report, "sent_bytes", None)
    recv = getattr(report, "recv_bytes", None)
    if sent is None or recv is None:
        raise TypeError(f"dlab.comm.algorithms' ring returned {type(report).__name__} without "
                        f"sent_bytes / recv_bytes; ddp counts the ring's bytes from them")
    return float(sent), float(recv)
