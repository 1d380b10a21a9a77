"""Timing the all-reduces on ranks: what ``python -m dlab bench allreduce`` and notebook 03 run
on every rank (under ``dlab.spawn``). A repeat's time is the slowest rank's, from a barrier to
its return; each figure is the median of the repeats after a warm-up. Beside the times: a
ping-pong between ranks 0 and 1 (one-way seconds per message size, to fit the alpha-beta
model), the seconds per byte of a large memory copy (shm's beta), and each algorithm's bytes
from one more untimed call through a ``Comm`` (the model, Gloo's model, the wire).
"""
from __future__ import annotations

import functools
import time
from statistics import median

import torch
import torch.distributed as dist

from dlab.comm.algorithms import ALGORITHMS
from dlab.comm.instrumented import Comm

MIB = 1 << 20
PINGPONG_SIZES = [4, 1 << 10, 16 << 10, 256 << 10, 4 * MIB, 16 * MIB]


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def pingpong(sizes: list[int], repeats: int) -> dict[int, float]:
    """One-way seconds per message size between ranks 0 and 1 (the others wait at a barrier)."""
    rank, out = dist.get_rank(), {}
    for size in sizes:
        buf = torch.zeros(max(1, size // 4))
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        out[size] = median(times[1:])
    dist.barrier()
    return out


def copy_seconds_per_byte(nbytes: int, repeats: int = 5) -> float:
    """Seconds per byte of a large memory copy on this rank (shm's beta)."""
    a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return median(times) / nbytes


def measure(sizes: list[int], repeats: int, warmup: int, algorithms: list[str]) -> dict:
    """On every rank: median seconds per (algorithm, size); 'gloo' is dist.all_reduce."""

    torch.set_num_threads(1)
    result = {"pingpong": pingpong(PINGPONG_SIZES, max(3, repeats)), "times": {}, "bytes": {},
              "copy": copy_seconds_per_byte(max(sizes))}
    for size in sizes:
        x = torch.ones(size // 4)
        for name in ["gloo", *algorithms]:
            fn = (lambda t: dist.all_reduce(t)) if name == "gloo" else ALGORITHMS[name]
            times = []
            reps = repeats if size >= 4 * MIB else 3 * repeats
            for i in range(warmup + reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn(x)
                t = _slowest(time.perf_counter() - t0)
                if i >= warmup:
                    times.append(t)
            result["times"][(name, size)] = median(times)
            result["bytes"][(name, size)] = _bytes_once(name, fn, x)
    return result


def _bytes_once(name: str, fn, x) -> tuple:
    """One more call, untimed, through a fresh ``Comm``: (model bytes sent, the model of Gloo's
    algorithm, bytes measured on the wire) on this rank. The model is the ring's for "gloo" and
    the algorithm's own count otherwise."""
    comm = Comm()
    if name == "gloo":
        comm.all_reduce(x)
        stats = comm.stats["all_reduce"]
    else:
        comm.run_algorithm(name, x.numel() * x.element_size(), functools.partial(fn, x))
        stats = comm.stats[name]
    return stats.sent_bytes, stats.gloo_bytes, stats.wire_bytes
