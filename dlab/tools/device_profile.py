"""``python -m dlab plan calibrate``: a machine measures itself into a cluster profile.

What the planner prices (``dlab.theory.plan.kernels``, ``collectives``) is measured here on
the device this process runs on (a GPU where there is one, else one CPU thread, as a lab rank
runs), and written as a profile (``dlab.theory.plan.cluster.dump``) that ``--cluster FILE`` and
``clusters.load`` read:

- matmul: FLOP/s over a grid of shapes (m, n, k), the median of a few timed repeats after a
  warm-up (``dlab.runtime.benchmark``: on a GPU each repeat several calls queued back to
  back); the best of them over the peak is the profile's ``matmul`` share, and the table
  replaces the quantization curve;
- attention: the fused causal attention (``scaled_dot_product_attention``) over sequence
  lengths, forward and backward, at its executed FLOPs (the causal half; backward 2.5 times
  forward, as ``dlab.theory.plan.ops`` counts them), on a GPU at a model's heads and enough
  tokens to fill it (``attention_shape``);
- memory bandwidth: a large copy's bytes read and written per second; the launch cost: a
  one-element op's seconds, queued back to back on a GPU (what a kernel adds to a step however
  small, not the host's round trip to wait for it);
- collectives, with ``ranks`` > 1: all-reduce, all-gather, reduce-scatter, all-to-all and a
  send/receive pair over message sizes on ``ranks`` fresh processes (Gloo on the CPU, NCCL on
  GPUs), the slowest rank's median; each op's latency per step and bus bandwidth fitted by
  least squares in relative error (``fit_link``) over the sizes. A fit that cannot be a link's
  (``unphysical``: a bus bandwidth above the memory's, as timings that do not grow with the
  bytes give on a busy machine) is left out and the profile's ``flags`` say so, as the
  calibration prints and every prediction from the profile repeats.

The peak is the data sheet's on a known GPU (``dlab.core.machine``) and the best measured
matmul on a CPU. The GPU presets' constants (``dlab.theory.plan.cluster``) come from published
figures; a profile measured on a GPU says what moved against them (``describe``).
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from dlab.core.machine import GPU_PEAK_FLOPS, usable_cores
from dlab.procs.spawn import spawn
from dlab.runtime.benchmark import benchmark
from dlab.theory.comm import AlphaBeta
from dlab.theory.plan import cluster as clusters
from dlab.theory.plan.collectives import bus_bytes, steps
from dlab.theory.plan.kernels import Kernels

QUICK = {"shapes": ((128, 128, 128), (256, 512, 256), (512, 512, 512), (256, 1024, 1024)),
         "seqs": (128, 512), "sizes": (1 << 12, 1 << 16, 1 << 20), "repeats": 3}
#: heads, head size and tokens a call of the attention on a GPU (``attention_shape``)
GPU_ATTENTION = (16, 128, 16384)
#: a GPU's grid: every doubling of n and k from 512 to 8192 and m to 16,384 tokens, so that
#: ``kernels.table_rate`` interpolates over factors of 2 (the first H200 profile's 27 shapes
#: left factors of 4 between rows; its whole calibration took 11 s)
FULL = {"shapes": tuple((m, n, k) for m in (256, 1024, 4096, 16384) for n in (512, 1024, 2048, 4096, 8192)
                        for k in (512, 1024, 2048, 4096, 8192)),
        "seqs": (512, 1024, 2048, 4096, 8192), "sizes": tuple(1 << p for p in range(12, 29, 2)),
        "repeats": 10, "attention": GPU_ATTENTION}
CPU_GRID = {**FULL, "shapes": tuple((m, n, k) for m in (64, 256, 1024) for n in (256, 1024)
                                     for k in (256, 1024)), "seqs": (128, 256, 512, 1024),
            "sizes": tuple(1 << p for p in range(12, 25, 3)), "repeats": 5, "attention": (4, 64, 0)}


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _seconds(fn, repeats: int) -> float:
    """Median seconds of one ``fn()`` after a warm-up, on this process's device (short kernels
    queued back to back on a GPU: ``dlab.runtime.benchmark``)."""
    return benchmark(fn, 1, repeats, _device())["median"]


def _dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def matmuls(shapes, repeats: int) -> tuple:
    """(m, n, k, FLOP/s) of each shape."""
    dev = _device()
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev, dtype=_dtype(dev))
        b = torch.randn(k, n, device=dev, dtype=_dtype(dev))
        out.append((m, n, k, 2.0 * m * n * k / _seconds(lambda a=a, b=b: a @ b, repeats)))
    return tuple(out)


def attention_shape(seq: int, grid: dict) -> tuple[int, int, int]:
    """(batch, heads, head size) of the attention timed at ``seq`` keys: on a GPU, a model's
    (16 heads of 128, FlashAttention-3's figures' head size) over ``tokens`` tokens a call, so
    that the kernel's tiles (one per head and 128 queries) fill the device many times over, as
    the planner's saturated rates assume; one sequence of 4 heads of 64 on one CPU thread.
    The first H200 session timed one sequence of 4 heads of 64 there: at 8,192 keys 177 TFLOP/s
    forward where the same GPU's attention step measured cuDNN's at 560 (2 x 16 heads of 128)."""
    heads, width, tokens = grid.get("attention", (4, 64, 0))
    return max(1, tokens // seq), heads, width


def attention(seqs, repeats: int, grid: dict | None = None) -> tuple:
    """(keys, forward FLOP/s, backward FLOP/s) of causal fused attention at each length, at
    ``attention_shape``'s batch and heads."""
    dev = _device()
    out = []
    for s in seqs:
        batch, heads, width = attention_shape(s, grid or {})
        q, k, v = (torch.randn(batch, heads, s, width, device=dev, dtype=_dtype(dev), requires_grad=True)
                   for _ in range(3))
        flops = 4.0 * batch * heads * s * (s / 2) * width  # the causal half, as the planner counts it

        def forward(q=q, k=k, v=v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        fwd = _seconds(forward, repeats)
        out_ = forward()
        grad = torch.ones_like(out_)
        def backward(o=out_, g=grad, ins=(q, k, v)):
            return torch.autograd.grad(o, ins, g, retain_graph=True)

        both = _seconds(backward, repeats)
        out.append((s, flops / fwd, 2.5 * flops / both))
    return tuple(out)


def bandwidth(repeats: int, nbytes: int = 1 << 28) -> float:
    """Bytes read and written per second by a large copy."""
    dev = _device()
    src = torch.empty(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds(lambda: dst.copy_(src), repeats)


def launch_cost(repeats: int = 50) -> float:
    """Seconds of a one-element op, back to back on a GPU: the fixed cost of a kernel."""
    x = torch.zeros(1, device=_device())
    return _seconds(lambda: x.add_(1.0), repeats)


OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def _collective(op: str, n: int, size: int):
    """A closure running one ``op`` of an ``size``-byte buffer on this rank."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    elems = max(size // 4 // n * n, n)
    buf, out = torch.zeros(elems, device=dev), torch.zeros(elems, device=dev)
    shard = torch.zeros(elems // n, device=dev)
    rank = dist.get_rank()
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, shard)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, buf)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out, buf)
    peer = rank ^ 1  # pairs 0-1, 2-3: a send each way, as a pipeline's neighbours swap

    def pair():
        if peer >= n:
            return
        ops = [dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, out, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return pair


def _time_collectives(sizes, repeats: int) -> dict:
    """On each rank: median seconds of every op at every size, all ranks starting together."""
    torch.set_num_threads(1)
    n = dist.get_world_size()
    out = {}
    for op in OPS:
        for size in sizes:
            fn = _collective(op, n, size)
            fn()
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                fn()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            out[(op, size)] = statistics.median(times)
    return out


def fit_link(op: str, n: int, points: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency per step, bus bandwidth) of ``op`` over ``n`` ranks through (bytes, seconds)
    points: least squares of ``t = steps x latency + bus bytes / busbw`` in relative error, each
    term at least 0 (a negative one refitted without it). Times that do not grow with the bytes
    give an infinite bandwidth, which ``unphysical`` flags."""
    x = np.array([bus_bytes(op, s, n) for s, _ in points])
    t = np.array([sec for _, sec in points])
    k = np.full_like(x, max(steps(op, n), 1))
    a = np.stack([k, x], axis=1) / t[:, None]
    (latency, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if latency < 0:  # the bytes alone
        latency, beta = 0.0, np.sum(x / t) / np.sum((x / t) ** 2)
    elif beta <= 0:  # the steps alone
        latency, beta = np.sum(k / t) / np.sum((k / t) ** 2), 0.0
    return float(latency), 1.0 / float(beta) if beta > 0 else math.inf


def unphysical(op: str, n: int, points: list[tuple[int, float]], latency: float, busbw: float,
               ceiling: float) -> str | None:
    """Why a fitted (latency, bus bandwidth) cannot be the link's, or None: a bus bandwidth above
    ``ceiling``, the rate this machine copies memory at (every byte a collective moves is read
    and written at least once), or a fixed part longer than the fastest call it was fitted to.
    Either means the timings were noise, as on a busy machine or at too few repeats."""
    if not busbw <= ceiling:
        return (f"{op}: its times do not grow with its bytes as a link's would (a fitted bus "
                f"bandwidth of {busbw / 1e9:.3g} GB/s, above the {ceiling / 1e9:.3g} GB/s this "
                f"machine copies memory at)")
    fastest = min(sec for _, sec in points)
    if steps(op, n) * latency > fastest:
        return (f"{op}: a fitted fixed part of {steps(op, n) * latency * 1e6:.3g} us, longer than "
                f"its fastest call ({fastest * 1e6:.3g} us)")
    return None


def collectives(ranks: int, sizes, repeats: int, ceiling: float,
                runs_dir: str = "runs") -> tuple[tuple, list[str]]:
    """(op, "intra", latency per step, bus bandwidth) of every op over ``ranks`` processes whose
    fit is physical (``unphysical``, under ``ceiling`` bytes/s), and why each other one is not."""
    per_rank = spawn(_time_collectives, ranks, sizes, repeats, runs_dir=runs_dir, name="calibrate",
                     timeout_s=120.0)
    out, flags = [], []
    for op in OPS:
        n = 2 if op == "p2p" else ranks
        points = [(size, max(r[(op, size)] for r in per_rank)) for size in sizes]
        latency, busbw = fit_link(op, n, points)
        why = unphysical(op, n, points, latency, busbw, ceiling)
        if why:
            flags.append(f"{why}: left out of the profile, so it is priced on the links; calibrate "
                         f"again on an idle machine, without --quick")
        else:
            out.append((op, "intra", latency, busbw))
    return tuple(out), flags


#: (latency per step, bus bandwidth) of the links where no collective was measured, as the
#: profile's flags say
PLACEHOLDER = (1e-5, 1e9)
NO_LINK = "no collective measured"


def measure(quick: bool = False, ranks: int = 2,
            runs_dir: str = "runs") -> tuple[clusters.Cluster, dict, list[str]]:
    """This machine as a cluster, every constant measured (module docstring), what was measured
    where (for the profile's ``measured`` field), and what could not be (its ``flags``)."""
    dev = _device()
    grid = QUICK if quick else (FULL if dev.type == "cuda" else CPU_GRID)
    if dev.type == "cuda":
        grid = {**grid, "attention": GPU_ATTENTION}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a lab rank's one thread
    try:
        table = matmuls(grid["shapes"], grid["repeats"])
        attn = attention(grid["seqs"], grid["repeats"], grid)
        hbm = bandwidth(grid["repeats"])
        launch = launch_cost()
    finally:
        torch.set_num_threads(threads)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({platform.machine()}, one thread)"
    known = next((m for m in GPU_PEAK_FLOPS if dev.type == "cuda" and m in name), None)
    best = max(table, key=lambda r: r[3])
    peak = GPU_PEAK_FLOPS[known]["bf16"] if known else best[3]
    ops, flags = collectives(ranks, grid["sizes"], grid["repeats"], hbm, runs_dir) if ranks > 1 else ((), [])
    by_op = {op: (lat, bw) for op, _, lat, bw in ops}
    base = "all_reduce" if "all_reduce" in by_op else next(iter(by_op), None)
    if base is None:
        flags.append(f"{NO_LINK}{' (--ranks 1)' if ranks == 1 else ''}: the links are a "
                     f"placeholder of {PLACEHOLDER[1] / 1e9:g} GB/s and {PLACEHOLDER[0] * 1e6:g} us a "
                     f"step, not this machine's; calibrate with --ranks 2 or more")
    elif base != "all_reduce":
        flags.append(f"the links are {base}'s fit, all_reduce's was left out")
    intra = AlphaBeta.link(*reversed(by_op.get(base, PLACEHOLDER)))
    memory = (torch.cuda.get_device_properties(0).total_memory if dev.type == "cuda"
              else _host_memory() / max(usable_cores(), 1))
    kernels = Kernels(matmul=best[3] / peak, sms=0, tile=(1, 1, 1), best=best[:3], fill=0.0,
                      attention=(("fa2", attn[-1][1] / peak, attn[-1][2] / peak),
                                 ("fa3", attn[-1][1] / peak, attn[-1][2] / peak)),
                      hbm=1.0, launch=launch, matmul_table=table, attention_table=attn)
    gpus_per_node = torch.cuda.device_count() if dev.type == "cuda" else usable_cores()
    cluster = clusters.Cluster(
        f"{name}, measured", peak, float(memory), hbm, max(gpus_per_node, 1), intra, intra,
        kernels.matmul, kernels.attention[0][1], reserved=0.0, kernels=kernels, ops=ops,
        spread=(("matmul", 0.95, 1.05), ("attention", 0.95, 1.05), ("hbm", 0.95, 1.05)),
        source="python -m dlab plan calibrate" + (" --quick" if quick else ""),
        generation={"H200": "H100"}.get(known, known or ""))  # an H200 is an H100's die
    measured = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": name,
                "torch": torch.__version__, "ranks": ranks, "quick": quick,
                "threads": 1 if dev.type == "cpu" else None}
    return cluster, measured, flags


def _host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def profile(path, quick: bool = False, ranks: int = 2, runs_dir: str = "runs") -> dict:
    """Measure this machine and write its profile to ``path``; the profile's fields."""
    cluster, measured, flags = measure(quick, ranks, runs_dir)
    return clusters.dump(cluster, path, measured, flags)


#: the preset of each GPU the planner knows, by a word of the device's name (an H200 before an
#: H100: the H200's kernels follow the H100's curves, its memory and data sheet are its own)
PRESET_OF = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"))


def preset_for(device: str) -> str | None:
    """The name of the preset of the GPU ``device`` names, or None (a CPU, an unknown GPU)."""
    return next((preset for word, preset in PRESET_OF if word in device), None)


def describe(doc: dict) -> str:
    """A profile's figures, and on a known GPU what moved against its preset's assumed constants."""
    k = doc["kernels"]
    best = max(r[3] for r in k["matmul_table"])
    lines = [f"{doc['name']} ({doc['measured'].get('date', '')}): best matmul {best / 1e12:.3g} "
             f"TFLOP/s ({k['matmul']:.0%} of the {doc['peak_flops'] / 1e12:.3g} TFLOP/s peak), "
             f"memory {doc['memory_bandwidth'] / 1e9:.3g} GB/s, a kernel {k['launch'] * 1e6:.1f} us"]
    lines += [f"  attention over {s} keys: forward {f / 1e12:.3g}, backward {b / 1e12:.3g} TFLOP/s"
              for s, f, b in k["attention_table"]]
    lines += [f"  {op} ({level}): {lat * 1e6:.1f} us a step, bus {bw / 1e9:.3g} GB/s"
              for op, level, lat, bw in doc["ops"]]
    lines += [f"  WARNING {flag}" for flag in doc.get("flags", [])]
    preset = preset_for(doc["measured"].get("device", "")) if doc.get("generation") else None
    if preset:
        ref = clusters.PRESETS[preset]
        lines.append(f"  against the {ref.name} preset: matmul share {k['matmul']:.3f} vs "
                     f"{ref.kernels.matmul:.3f}, memory {doc['memory_bandwidth'] / ref.hbm:.0%} of "
                     f"the data sheet")
    return "\n".join(lines)
