"""Scaled dot-product attention's kernels against the sequence length: PyTorch's SDPA picks one
of flash (Dao 2023, FlashAttention-2), memory-efficient (Rabe and Staats 2021, xFormers),
cuDNN's fused attention, or the math path (the softmax written out, the s x s scores kept);
``torch.nn.attention.sdpa_kernel`` forces one. For each kernel and length: forward and
backward seconds (``dlab.runtime.benchmark``, median after warm-up), the TFLOP/s of the causal
half (forward 4 b a s^2 h_a / 2, backward 2.5 times it, as FlashAttention's papers count),
the bytes autograd saved for the backward (``dlab.core.metrics.ActivationMeter``: the math
path keeps the s x s probabilities, the fused kernels their output and one log-sum-exp per
row) and, on a GPU, the allocator's peak above what was allocated before.

A kernel this machine lacks (flash and memory-efficient on the CPU, cuDNN before its version,
any of them for a head size or dtype it does not take) or a length that does not fit is a row
that says why, not a failed step.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dlab.core.metrics import ActivationMeter
from dlab.runtime.benchmark import benchmark

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
#: (batch, heads, head size, lengths): FlashAttention-3's figures use head size 128
GPU = {"batch": 2, "heads": 16, "head_dim": 128, "seqs": (512, 1024, 2048, 4096, 8192, 16384)}
GPU_QUICK = {**GPU, "seqs": (1024, 4096)}
CPU = {"batch": 1, "heads": 2, "head_dim": 32, "seqs": (64, 256)}


def causal_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention: q k^T and p v, 2 s^2 h_a each, the causal half."""
    return 4.0 * batch * heads * seq * seq * head_dim / 2


def measure(backend: str, batch: int, heads: int, seq: int, head_dim: int, dtype, device,
            repeats: int) -> dict:
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    cuda = device.type == "cuda"
    with sdpa_kernel(BACKENDS[backend]):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        meter = ActivationMeter()
        with meter.track():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.ones_like(out)
        out.backward(grad)
        peak = torch.cuda.max_memory_allocated() - before if cuda else None
        forward = benchmark(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            1, repeats, device)["median"]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        backward = benchmark(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                             1, repeats, device)["median"]
    flops = causal_flops(batch, heads, seq, head_dim)
    return {"forward_s": forward, "backward_s": backward,
            "tflops": 3.5 * flops / (forward + backward) / 1e12,
            "saved_bytes": meter.peak, "peak_bytes": peak, "why": None}


#: kernels PyTorch has only for CUDA (its CPU has flash and math)
CUDA_ONLY = ("efficient", "cudnn")


def _why(e: Exception, caught: list) -> str:
    """Why a kernel did not run: SDPA's error is generic ("no viable backend"); the reason it
    gives for the kernel it was asked for comes as a warning."""
    text = str(e).strip().splitlines()
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of memory: " + (text[0][:160] if text else "")
    reasons = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return "; ".join(reasons[:2] or [text[0] if text else type(e).__name__])[:300]


def run(ctx):
    shape = (GPU_QUICK if ctx.quick else GPU) if ctx.cuda else CPU
    device = torch.device("cuda" if ctx.cuda else "cpu")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    rows = []
    for backend in BACKENDS:
        for seq in shape["seqs"]:
            row = {"backend": backend, "seq": seq, "forward_s": None, "backward_s": None,
                   "tflops": None, "saved_bytes": None, "peak_bytes": None}
            if not ctx.cuda and backend in CUDA_ONLY:
                rows.append({**row, "why": "a CUDA kernel: PyTorch has none on the CPU"})
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    row |= measure(backend, shape["batch"], shape["heads"], seq, shape["head_dim"],
                                   dtype, device, repeats=5 if ctx.cuda else 2)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                    row["why"] = _why(e, caught)
                finally:
                    if ctx.cuda:
                        torch.cuda.empty_cache()
            rows.append(row)
    doc = {"dtype": str(dtype).removeprefix("torch."), "batch": shape["batch"], "heads": shape["heads"],
           "head_dim": shape["head_dim"], "rows": rows}
    done = [r for r in rows if r["tflops"]]
    best = max(done, key=lambda r: r["tflops"])
    line = (f"{len(done)} of {len(rows)} (kernel, s) measured; best {best['backend']} at s = {best['seq']}: "
            f"{best['tflops']:.3g} TFLOP/s")
    return doc, line, []
