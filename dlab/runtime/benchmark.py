"""Timing a step on one device, done right, and the utilization it implies.

A timing is trustworthy when (1) the first calls, which pay for allocation, caches and lazy
initialisation, are run and thrown away (warm-up); (2) the clock is read only after the device
finished the work (on CUDA kernels are queued: ``dlab.core.metrics.Stopwatch`` synchronises);
(3) several repeats are summarised by their median, which one slow repeat (another process on
the core, a page fault) does not move, where the mean would move.

Utilization (Chowdhery et al. 2022, PaLM, app. B; Korthikanti et al. 2022, sec. 6): MFU divides
the FLOPs the model needs per token (``GPTConfig.flops_per_token``, 6 N + 12 L d T) times the
tokens per second by the device's peak; HFU counts the FLOPs the hardware ran, recomputed
forwards included (``GPTConfig.hardware_flops_per_token``). ``utilization`` is
``dlab.models.flops.utilization``, the one function ``dlab.worker.train`` records per step with
and the planner predicts with, for ``world_size`` devices.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

from dlab.core.metrics import Stopwatch
from dlab.models.flops import utilization

__all__ = ["benchmark", "calls_per_sample", "utilization"]


#: on a GPU, a timed sample holds at least this much work: one kernel between two
#: synchronisations is mostly the host's round trip when it is short
SAMPLE_S = 1e-3
MAX_CALLS = 200


def calls_per_sample(one_call_s: float, cuda: bool) -> int:
    """Back-to-back calls per timed sample. A GPU runs kernels queued one after another, as a
    training step does, and the planner adds each kernel's launch cost itself
    (``dlab.theory.plan.kernels.Kernels.launch``): a call timed between two synchronisations
    holds the host's round trip (about 20 us on an H200, 2026-11-29), which for a short kernel
    is most of what is timed. On the CPU a call is its own work: one."""
    if not cuda or one_call_s <= 0:
        return 1
    return max(1, min(MAX_CALLS, math.ceil(SAMPLE_S / one_call_s)))


def benchmark(fn: Callable[[], object], warmup: int = 2, repeats: int = 5,
              device: torch.device | str = "cpu") -> dict:
    """Seconds per call of ``fn``: the median of ``repeats`` timed samples after ``warmup``
    untimed calls, with every sample (``times``), the fastest and the slowest. On a GPU a
    sample is ``calls_per_sample`` calls queued back to back, divided by their number."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"benchmark needs warmup >= 0 and repeats >= 1 (got warmup={warmup}, "
                         f"repeats={repeats})")
    device = torch.device(device)
    clock = Stopwatch(device)
    for _ in range(warmup):
        fn()
    calls = 1
    if device.type == "cuda":
        start = clock.now()
        fn()
        calls = calls_per_sample(clock.now() - start, cuda=True)
    times = []
    for _ in range(repeats):
        start = clock.now()
        for _ in range(calls):
            fn()
        times.append((clock.now() - start) / calls)
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "times": times}
