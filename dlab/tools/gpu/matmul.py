"""Matmul throughput by precision against the peak and the roofline (Williams et al. 2009).

Square n x n matmuls at each precision the device has: fp32 (TF32 off), TF32, bf16 and, on
FP8 tensor cores (compute capability 8.9 and above), FP8 e4m3 through ``torch._scaled_mm`` (bf16
out). A matmul's arithmetic intensity is its FLOPs over the bytes it must move at least,
2 n^3 / ((2 n^2 x input bytes + n^2 x output bytes)); the roofline's attainable rate is
``min(peak, intensity x memory bandwidth)``, so a small matmul is bound by bytes and a large one
by the tensor cores. Every call reads operands no cache holds (the sets cycle through twice the
GPU's L2), as the roofline assumes. Each row gives the measured TFLOP/s, its share of the datasheet peak
(``dlab.core.machine`` for bf16 and fp32, ``published.H100_SXM`` for TF32 and FP8 on an H100
or H200; on a CPU the best fp32 matmul measured here) and of the roofline. The bandwidth is
measured here (``dlab.tools.device_profile.bandwidth``: a 256 MiB copy).
"""
from __future__ import annotations

import itertools
import math

import torch

from dlab.core.machine import GPU_PEAK_FLOPS
from dlab.runtime.benchmark import benchmark
from dlab.tools import device_profile
from dlab.tools.gpu import environment, published

#: (input bytes, output bytes) per element
BYTES = {"fp32": (4, 4), "tf32": (4, 4), "bf16": (2, 2), "fp8": (1, 2)}
GPU_SIZES, GPU_QUICK, CPU_SIZES = (256, 512, 1024, 2048, 4096, 8192), (512, 4096), (64, 256)


def intensity(dtype: str, n: int) -> float:
    inp, out = BYTES[dtype]
    return 2.0 * n ** 3 / (2 * n * n * inp + n * n * out)


def peak(dtype: str, name: str) -> tuple[float | None, str]:
    """The datasheet's dense peak of ``dtype`` on the GPU ``name`` (None where not tabled)."""
    if dtype in published.H100_SXM["peak"] and any(m in name for m in ("H100", "H200")):
        return published.H100_SXM["peak"][dtype], published.H100_SXM["source"]
    for model, peaks in GPU_PEAK_FLOPS.items():
        if model in name and dtype in peaks:
            return peaks[dtype], f"datasheet {model} {dtype} (dlab.core.machine)"
    return None, f"no datasheet {dtype} peak tabled for {name}"


def _copies(dtype: str, n: int, device) -> int:
    """Operand sets to cycle through so that every call reads its inputs from memory, not from a
    cache the last call filled: twice the GPU's L2 (an H100's 50 MB holds two 2048 x 2048 bf16
    operands whole), at most 256 sets."""
    if device.type != "cuda":
        return 1
    inp, _ = BYTES[dtype]
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(256, math.ceil(2 * l2 / (2 * n * n * inp))))


def _operands(dtype: str, n: int, device):
    """A call of one n x n x n matmul at ``dtype``, each call on the next operand set."""
    sets = []
    for _ in range(_copies(dtype, n, device)):
        if dtype == "fp8":
            a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt asks
        else:
            kind = torch.bfloat16 if dtype == "bf16" else torch.float32
            a, b = (torch.randn(n, n, device=device, dtype=kind) for _ in range(2))
        sets.append((a, b))
    one = torch.ones((), device=device)
    turn = itertools.cycle(sets)

    def call():
        a, b = next(turn)
        if dtype == "fp8":
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return a @ b
    return call


def rate(dtype: str, n: int, device, repeats: int) -> float:
    """Measured seconds of one n x n x n matmul at ``dtype``."""
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        return benchmark(_operands(dtype, n, device), 2, repeats, device)["median"]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def _measured(dtype: str, n: int, device, repeats: int, top: float | None, bandwidth: float) -> dict:
    """One row's rates. The roofline share only on a GPU: a CPU's caches hold these small
    operands across calls, so its memory bandwidth bounds nothing here."""
    seconds = rate(dtype, n, device, repeats)
    flops = 2.0 * n ** 3 / seconds
    attainable = min(top or float("inf"), intensity(dtype, n) * bandwidth)
    return {"seconds": seconds, "tflops": flops / 1e12, "share": flops / top if top else None,
            "roofline": flops / attainable if device.type == "cuda" else None}


def _why(dtype: str, cuda: bool, fp8: bool) -> str | None:
    if not cuda:
        return None if dtype in ("fp32", "bf16") else "needs CUDA"
    return "no FP8 tensor cores (compute capability < 8.9)" if dtype == "fp8" and not fp8 else None


def run(ctx):
    device = torch.device("cuda" if ctx.cuda else "cpu")
    threads = torch.get_num_threads()
    if not ctx.cuda:
        torch.set_num_threads(1)  # a lab rank's one thread
    try:
        bandwidth = device_profile.bandwidth(3)
        fp8 = environment.features(ctx.cuda)["fp8"]
        sizes = (GPU_QUICK if ctx.quick else GPU_SIZES) if ctx.cuda else CPU_SIZES
        repeats = 10 if ctx.cuda else 3
        if not ctx.cuda:  # a CPU has no datasheet peak: its best fp32 matmul stands for one
            best = max(2.0 * n ** 3 / rate("fp32", n, device, repeats) for n in sizes)
        rows = []
        for dtype in BYTES:
            if ctx.cuda:
                top, source = peak(dtype, ctx.device)
            else:
                top, source = ((best, "the best fp32 matmul measured here, one thread")
                               if dtype == "fp32" else (None, "no datasheet peak for a CPU"))
            why = _why(dtype, ctx.cuda, fp8)
            for n in sizes:
                row = {"dtype": dtype, "n": n, "intensity": intensity(dtype, n), "peak": top,
                       "peak_source": source, "seconds": None, "tflops": None, "share": None,
                       "roofline": None, "why": why}
                if why is None:
                    try:
                        row |= _measured(dtype, n, device, repeats, top, bandwidth)
                    except RuntimeError as e:
                        row["why"] = str(e).strip().splitlines()[0][:200]
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    doc = {"bandwidth": bandwidth, "bandwidth_source": "measured: a 256 MiB copy "
           "(dlab.tools.device_profile.bandwidth)", "rows": rows}
    best_of = {}
    for r in rows:
        if r["tflops"] and r["tflops"] > best_of.get(r["dtype"], (0,))[0]:
            best_of[r["dtype"]] = (r["tflops"], r["share"])
    line = ", ".join(f"{d} {t:.3g} TFLOP/s" + (f" ({s:.0%} of peak)" if s else "")
                     for d, (t, s) in best_of.items())
    return doc, line, []
