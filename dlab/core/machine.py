"""What this machine offers a run: its usable cores, its GPUs, the peak FLOP/s that MFU divides
by (the CPU's measured, a GPU's from the one table of datasheet peaks)."""
from __future__ import annotations

import functools
import os
import time

import torch

# Dense peak FLOP/s of known GPUs (vendor datasheets, SXM parts, no sparsity).
GPU_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp32": 31.2e12},
    "T4": {"bf16": 65e12, "fp32": 8.1e12},  # fp16 tensor cores; T4 has no bf16
}


def usable_cores() -> int:
    """Cores this process may run on (a container or ``taskset`` may allow fewer than the
    machine has; Colab's free machines have 2)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.cache
def measure_cpu_peak_flops(threads: int = 1, n: int = 512, seconds: float = 0.3) -> float:
    """fp32 matmul FLOP/s of this CPU with ``threads`` threads: the MFU denominator on CPU.
    Measured once per process; the launcher passes its figure to the ranks, which would
    otherwise measure it all at once, competing for the same cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            reps += 1
        return 2 * n ** 3 * reps / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(old)


def device_peak_flops(device: torch.device, threads: int = 1, dtype: str = "fp32") -> tuple[float, str]:
    """Peak FLOP/s and where the figure comes from (measured, or the GPU table)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for model, peaks in GPU_PEAK_FLOPS.items():
            if model in name:
                return peaks[dtype], f"datasheet {model} {dtype}"
        return float("nan"), f"unknown GPU {name!r}"
    if os.environ.get("DLAB_CPU_PEAK_FLOPS"):  # measured once by the launcher, on a quiet CPU
        return float(os.environ["DLAB_CPU_PEAK_FLOPS"]), f"measured fp32 matmul, {threads} thread(s)"
    return measure_cpu_peak_flops(threads), f"measured fp32 matmul, {threads} thread(s)"
