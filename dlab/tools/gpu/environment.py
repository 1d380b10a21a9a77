"""The session's first step: what ran the measurements (versions, GPUs, what they support), so
every figure of the folder can be read against its device, driver and library versions."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dlab.core.machine import usable_cores

#: the first compute capability with FP8 tensor cores (Ada, Hopper: 8.9 and 9.0)
FP8_CAPABILITY = (8, 9)


def _command(args: list[str]) -> str | None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def versions(cuda: bool) -> dict:
    """Every version a reader needs to compare two sessions (None where not present)."""
    nccl = torch.cuda.nccl.version() if cuda else None
    repo = Path(__file__).resolve().parents[3]
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": str(torch.backends.cudnn.version()) if cuda else None,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (str(nccl) if nccl else None),
            "driver": _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
            if cuda else None,
            "python": platform.python_version(),
            "dlab": _command(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])}


def features(cuda: bool) -> dict:
    cap = torch.cuda.get_device_capability(0) if cuda else (0, 0)
    return {"cuda": cuda, "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
            "fp8": cuda and cap >= FP8_CAPABILITY,
            "flash_sdp": cuda and torch.backends.cuda.is_flash_attention_available(),
            "nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available()}


def gpus(cuda: bool) -> list[dict]:
    out = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                    "memory_bytes": p.total_memory, "sms": p.multi_processor_count})
    return out


def run(ctx):
    info = {"versions": versions(ctx.cuda), "python": sys.version.split()[0],
            "platform": platform.platform(), "cpu_cores": usable_cores(), "gpus": gpus(ctx.cuda),
            "features": features(ctx.cuda),
            "nvidia_smi": _command(["nvidia-smi"]) if ctx.cuda else None}
    v = info["versions"]
    summary = (f"torch {v['torch']}, CUDA {v['cuda']}, driver {v['driver']}, {len(info['gpus'])} GPU(s)"
               if ctx.cuda else f"torch {v['torch']}, no CUDA: {info['cpu_cores']} CPU core(s)")
    return info, summary, []
