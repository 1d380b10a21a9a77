"""``python -m dlab bench allreduce``: every hand-written all-reduce beside Gloo's own.

For 2 and 4 ranks (one ``spawn`` per world size, so process start-up is paid twice) and
message sizes from 4 KiB to 64 MiB, each algorithm runs ``warmup`` times, then ``repeats``
timed times; a repeat's time is the slowest rank's, from a barrier to its return, and the row
shows the median. Bandwidths follow nccl-tests: algbw = S / t, busbw = algbw * 2 (N-1)/N, so a
bus bandwidth compares algorithms (and world sizes) on what each link carried. The ratio is
busbw / busbw of ``dist.all_reduce`` at the same size and ranks.

The cost model beside each row is the alpha-beta formula of ``dlab.theory.comm`` with alpha
and beta fitted, in the same processes, to a ping-pong between ranks 0 and 1 (half a round trip
per message size), and for "shm" the seconds per byte of a large memory copy. It knows nothing
of the two cores the ranks share, nor of the reduction's own memory traffic, which is why it
flatters the large messages on 4 ranks: the notebook discusses the gap.

Bytes, rank 0's, from one more untimed call: ``model_bytes`` (the ring model for Gloo's
all_reduce, the algorithm's own count for dlab's), ``gloo_model_bytes`` (the model of what Gloo
writes for it, framing included: ``dlab.comm.gloo``) and ``wire_bytes`` (measured on
the wire, ``dlab.comm.wire``; "shm" writes only its barriers' few bytes).
"""
from __future__ import annotations

import time

import dlab
from dlab.bench import compared, median
from dlab.comm.wire import NOT_MEASURABLE

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [4 * KIB, MIB]
PINGPONG_SIZES = [4, 1 * KIB, 16 * KIB, 256 * KIB, 4 * MIB, 16 * MIB]


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def pingpong(sizes: list[int], repeats: int) -> dict[int, float]:
    """One-way seconds per message size between ranks 0 and 1 (the others wait at a barrier)."""
    import torch
    import torch.distributed as dist
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
    import torch
    a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return median(times) / nbytes


def measure(sizes: list[int], repeats: int, warmup: int, algorithms: list[str]) -> dict:
    """On every rank: median seconds per (algorithm, size); 'gloo' is dist.all_reduce."""
    import torch
    import torch.distributed as dist

    from dlab.comm.algorithms import ALGORITHMS
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
    import functools

    from dlab.comm.instrumented import Comm

    comm = Comm()
    if name == "gloo":
        comm.all_reduce(x)
        stats = comm.stats["all_reduce"]
    else:
        comm.run_algorithm(name, x.numel() * x.element_size(), functools.partial(fn, x))
        stats = comm.stats[name]
    return stats.sent_bytes, stats.gloo_bytes, stats.wire_bytes


def run(quick: bool = False, world_sizes=(2, 4), runs_dir: str = "runs") -> list[dict]:
    from dlab.comm.algorithms import ALGORITHMS
    from dlab.theory.comm import AlphaBeta, allreduce_time, bus_bandwidth, fit_alpha_beta
    sizes = QUICK_SIZES if quick else SIZES
    repeats, warmup = (3, 1) if quick else (5, 2)
    names = list(ALGORITHMS)
    rows = []
    for n in world_sizes:
        res = dlab.spawn(measure, n, sizes, repeats, warmup, names, runs_dir=runs_dir,
                         timeout_s=600, name=f"bench-allreduce-{n}")[0]
        pp = res["pingpong"]
        link = fit_alpha_beta(list(pp), list(pp.values()), relative=True)
        memory = AlphaBeta(0.0, res["copy"])
        for size in sizes:
            gloo = res["times"][("gloo", size)]
            for name in ["gloo", *names]:
                t = res["times"][(name, size)]
                model_name = "ring" if name == "gloo" else name  # Gloo's large all_reduce is a ring
                model_bytes, gloo_bytes, wire_bytes = res["bytes"][(name, size)]
                rows.append(compared(
                    bus_bandwidth(size, t, n) / 1e9, bus_bandwidth(size, gloo, n) / 1e9,
                    algorithm=name, ranks=n, size=_size_label(size), ms=t * 1e3,
                    model_ms=allreduce_time(model_name, size, n, link, memory) * 1e3,
                    algbw=size / t / 1e9, metric="busbw GB/s", model_bytes=model_bytes,
                    gloo_model_bytes=gloo_bytes,
                    wire_bytes=NOT_MEASURABLE if wire_bytes is None else wire_bytes))
        rows.append({"algorithm": "(fitted link)", "ranks": n, "alpha_us": link.alpha * 1e6,
                     "link GB/s": link.bandwidth / 1e9, "copy GB/s": memory.bandwidth / 1e9})
    return rows


def _size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
