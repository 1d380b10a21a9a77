"""The lab GPT's training step as the profile and allocator steps run it: ``single`` (the
ground-truth strategy, ``dlab.parallel.reference``) on a one-rank process group (NCCL on a
GPU, Gloo on the CPU), at a GPU-sized config (GPT-2 small's shape: 12 layers, h = 768, s =
1024, bf16 with fp32 masters) or, without CUDA, a CPU-sized one.

Its timeline is dlab's own (``dlab.core.events.Timeline``, the spans the strategy opens:
forward, backward, optimizer), each span also marked in the profiler's trace
(``record_function("dlab:<kind>")``) so that the kernels can be summed by the phase that
launched them, and a hook can read memory at each span's end.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from dlab import parallel
from dlab.comm.instrumented import Comm
from dlab.core.config import RunConfig
from dlab.core.events import Timeline
from dlab.models.data import make_data
from dlab.parallel.base import Context

GPU = {"model_options": {"n_layer": 12, "d_model": 768, "n_head": 12, "seq_len": 1024},
       "batch_size": 8, "options": {"precision": "bf16"}}
CPU = {"model_options": {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64},
       "batch_size": 4, "options": {"precision": "fp32"}}


def config(cuda: bool) -> RunConfig:
    return RunConfig(strategy="single", world_size=1, model="gpt", optimizer="adam",
                     device="cuda" if cuda else "cpu", **(GPU if cuda else CPU))


class MarkedTimeline(Timeline):
    """dlab's timeline, each span also marked for the profiler; ``on_end(kind)`` runs after
    each span closes."""

    def __init__(self, on_end=None):
        super().__init__()
        self.on_end = on_end

    @contextmanager
    def span(self, kind: str, **fields):
        with torch.profiler.record_function(f"dlab:{kind}"), super().span(kind, **fields):
            yield
        if self.on_end:
            self.on_end(kind)


@contextmanager
def one_rank(cuda: bool):
    """A process group of this process alone: what ``single`` runs on in a launched run."""
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(cfg: RunConfig, timeline: Timeline):
    """``single``, set up on this rank, and the run's data."""
    device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    strategy = parallel.get("single")(Context(cfg, 0, 1, 0, device, timeline, Comm()))
    strategy.setup()
    return strategy, make_data(cfg)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
