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

import statistics
from collections.abc import Callable

import torch

from dlab.core.metrics import Stopwatch
from dlab.models.flops import utilization

__all__ = ["benchmark", "utilization"]


def benchmark(fn: Callable[[], object], warmup: int = 2, repeats: int = 5,
              device: torch.device | str = "cpu") -> dict:
    """Seconds per call of ``fn``: the median of ``repeats`` timed calls after ``warmup``
    untimed ones, with every timed call (``times``), the fastest and the slowest."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"benchmark needs warmup >= 0 and repeats >= 1 (got warmup={warmup}, "
                         f"repeats={repeats})")
    clock = Stopwatch(torch.device(device))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock.now()
        fn()
        times.append(clock.now() - start)
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "times": times}
