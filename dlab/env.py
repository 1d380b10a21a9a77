"""``python -m dlab env``: what this machine offers a distributed run."""
from __future__ import annotations

import os
import platform

import torch
import torch.distributed as dist

from dlab.metrics import measure_cpu_peak_flops


def report(measure: bool = True) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
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
    lines = [f"python {info['python']}   torch {info['torch']}   {info['cpu_cores']} CPU cores",
             "backends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["backends"].items()),
             "GPUs: " + (", ".join(info["gpus"]) or "none"),
             f"backend='auto' means: {info['auto_backend']}"]
    if "cpu_fp32_gflops_1_thread" in info:
        lines.append(f"CPU fp32 matmul peak: {info['cpu_fp32_gflops_1_thread']:.1f} GFLOP/s on 1 "
                     f"thread, {info['cpu_fp32_gflops_all_threads']:.1f} on all "
                     f"(the MFU denominator on CPU)")
    return "\n".join(lines)
