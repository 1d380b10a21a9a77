"""Collectives on this machine's GPUs, nccl-tests' way: each op's time over message sizes, the
slowest rank's median, and its bus bandwidth (bytes a rank moves on the bus per second:
``dlab.theory.plan.collectives.bus_bytes``, 2 (n-1)/n S for an all-reduce, (n-1)/n S for an
all-gather or reduce-scatter).

- NCCL over every GPU of the machine (``spawn``: NCCL where each rank has a GPU). On one GPU
  that is one rank: nothing crosses a link, and the time is NCCL's fixed cost per call (no bus
  bandwidth);
- Gloo over two ranks with CUDA tensors (a Gloo group beside NCCL's where there are two GPUs or
  more): Gloo stages CUDA tensors through host memory, which is how dlab's multi-rank
  strategies run on one GPU (``dlab check``);
- without CUDA, Gloo over two ranks on the CPU, and the NCCL rows say why they are empty.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dlab.analysis.diagnose import RunFailed
from dlab.procs.spawn import spawn
from dlab.theory.plan.collectives import bus_bytes

OPS = ("all_reduce", "all_gather", "reduce_scatter")
GPU_SIZES = tuple(1 << p for p in range(10, 29, 3))  # 1 KiB to 256 MiB
GPU_QUICK, CPU_SIZES = (1 << 10, 1 << 20, 1 << 26), (1 << 10, 1 << 18)
#: Gloo stages CUDA tensors through the host at a few GB/s: up to 64 MiB keeps it to seconds
GLOO_LARGEST = 1 << 26


def _call(op: str, buf, out, shard, group):
    if op == "all_reduce":
        return dist.all_reduce(buf, group=group)
    if op == "all_gather":
        return dist.all_gather_into_tensor(out, shard, group=group)
    return dist.reduce_scatter_tensor(shard, buf, group=group)


def time_ops(sizes, repeats: int, backend: str | None, cuda_tensors: bool) -> dict:
    """On each rank: {(op, bytes): median seconds or the error's first line}, in a group of
    ``backend`` over every rank (None: the default group)."""
    group = dist.new_group(backend=backend) if backend else None
    n = dist.get_world_size(group)
    device = (torch.device("cuda", torch.cuda.current_device() if torch.cuda.device_count() > 1 else 0)
              if cuda_tensors else torch.device("cpu"))
    out = {}
    for op in OPS:
        for size in sizes:
            elems = max(size // 4 // n * n, n)
            buf, gathered = torch.ones(elems, device=device), torch.empty(elems, device=device)
            shard = torch.ones(elems // n, device=device)
            try:
                _call(op, buf, gathered, shard, group)
                times = []
                for _ in range(repeats):
                    dist.barrier(group=group)
                    start = time.perf_counter()
                    _call(op, buf, gathered, shard, group)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - start)
                out[(op, size)] = statistics.median(times)
            except RuntimeError as e:
                out[(op, size)] = str(e).strip().splitlines()[0][:200]
    return out


def _rows(per_rank: list[dict], backend: str, tensors: str, sizes) -> list[dict]:
    n = len(per_rank)
    rows = []
    for op in OPS:
        for size in sizes:
            got = [r[(op, size)] for r in per_rank]
            bad = next((g for g in got if isinstance(g, str)), None)
            seconds = None if bad else max(got)
            busbw = bus_bytes(op, size, n) / seconds if seconds and n > 1 else None
            rows.append({"backend": backend, "tensors": tensors, "ranks": n, "op": op, "bytes": size,
                         "seconds": seconds, "busbw": busbw, "why": bad})
    return rows


def _none(backend: str, tensors: str, ranks: int, sizes, why: str) -> list[dict]:
    return [{"backend": backend, "tensors": tensors, "ranks": ranks, "op": op, "bytes": size,
             "seconds": None, "busbw": None, "why": why} for op in OPS for size in sizes]


def _measured(backend: str, tensors: str, ranks: int, sizes, repeats: int, group: str | None,
              runs: str) -> list[dict]:
    """One spawned run's rows; a run that fails or hangs is rows that say so, not a lost step
    (the other backend's rows are kept)."""
    try:
        per_rank = spawn(time_ops, ranks, sizes, repeats, group, tensors == "cuda", runs_dir=runs,
                         timeout_s=120)
    except (RunFailed, TimeoutError) as e:
        return _none(backend, tensors, ranks, sizes, f"the run failed: {str(e).splitlines()[0][:200]}")
    return _rows(per_rank, backend, tensors, sizes)


def run(ctx):
    runs = f"{ctx.runs_dir}/collectives"
    sizes = (GPU_QUICK if ctx.quick else GPU_SIZES) if ctx.cuda else CPU_SIZES
    repeats = 10 if ctx.cuda else 3
    if ctx.cuda:
        gpus = torch.cuda.device_count()
        rows = _measured("nccl", "cuda", gpus, sizes, repeats, None, runs)
        rows += _measured("gloo", "cuda", 2, tuple(s for s in sizes if s <= GLOO_LARGEST), repeats,
                          "gloo" if gpus >= 2 else None, runs)
    else:
        rows = _none("nccl", "cuda", 0, sizes, "no CUDA")
        rows += _measured("gloo", "cpu", 2, sizes, repeats, None, runs)
    largest = max(r["bytes"] for r in rows if r["backend"] == "gloo")
    line = "; ".join(f"{r['backend']} {r['tensors']} x{r['ranks']} all-reduce of {largest >> 10} KiB: "
                     + (f"{r['seconds'] * 1e6:.0f} us" if r["seconds"] else r["why"])
                     + (f", bus {r['busbw'] / 1e9:.3g} GB/s" if r["busbw"] else "")
                     for r in rows if r["op"] == "all_reduce" and r["bytes"] == largest)
    return {"rows": rows}, line, []
