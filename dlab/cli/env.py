"""``python -m dlab env``: what this machine offers a distributed run."""
from __future__ import annotations

import os
import platform

import torch
import torch.distributed as dist

from dlab.core.machine import measure_cpu_peak_flops, usable_cores


def sharing(ranks: tuple[int, ...], cores: int) -> str | None:
    """What running each of ``ranks`` ranks (one thread each) on ``cores`` cores does to
    timings, or None when every rank has a core of its own."""
    over = [n for n in ranks if n > cores]
    if not over:
        return None
    each = ", ".join(f"{n} ranks up to {n / cores:.1f}x" for n in over)
    return (f"runs of more than {cores} ranks share the {cores} cores: ranks take turns, so a "
            f"step's time includes waiting for a core ({each} the work's own time), a rank "
            f"waiting in a collective lends its core to another, and MFU reads low. Compare "
            f"times at the same number of ranks; losses, parameters and bytes are exact "
            f"whatever the cores.")


def report(measure: bool = True, ranks: tuple[int, ...] = (2, 4, 8)) -> dict:
    cores = usable_cores()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "usable_cores": cores,
        "core_sharing": sharing(ranks, cores),
        "backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                     "mpi": dist.is_mpi_available()},
        "cuda": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
    }
    if measure:
        info["cpu_fp32_gflops_1_thread"] = measure_cpu_peak_flops(1) / 1e9
        info["cpu_fp32_gflops_all_threads"] = measure_cpu_peak_flops(os.cpu_count() or 1) / 1e9
    gpus = len(info["gpus"])
    info["auto_backend"] = (f"nccl on up to {gpus} rank(s), gloo beyond" if gpus
                            else "gloo on CPU (no CUDA GPU here)")
    return info


def format_report(info: dict) -> str:
    lines = [f"python {info['python']}   torch {info['torch']}   {info['cpu_cores']} CPU cores "
             f"({info['usable_cores']} usable here)",
             "backends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["backends"].items()),
             "GPUs: " + (", ".join(info["gpus"]) or "none"),
             f"backend='auto' means: {info['auto_backend']}"]
    if "cpu_fp32_gflops_1_thread" in info:
        lines.append(f"CPU fp32 matmul peak: {info['cpu_fp32_gflops_1_thread']:.1f} GFLOP/s on 1 "
                     f"thread, {info['cpu_fp32_gflops_all_threads']:.1f} on all "
                     f"(the MFU denominator on CPU)")
    if info["core_sharing"]:
        lines.append("note: " + info["core_sharing"])
    return "\n".join(lines)
