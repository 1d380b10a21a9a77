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

from dlab.bench import compared
from dlab.comm.algorithms import ALGORITHMS
from dlab.comm.algorithms.timing import measure
from dlab.comm.wire import NOT_MEASURABLE
from dlab.procs.spawn import spawn
from dlab.theory.comm import AlphaBeta, allreduce_time, bus_bandwidth, fit_alpha_beta

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [4 * KIB, MIB]


def run(quick: bool = False, world_sizes=(2, 4), runs_dir: str = "runs") -> list[dict]:
    sizes = QUICK_SIZES if quick else SIZES
    repeats, warmup = (3, 1) if quick else (5, 2)
    names = list(ALGORITHMS)
    rows = []
    for n in world_sizes:
        res = spawn(measure, n, sizes, repeats, warmup, names, runs_dir=runs_dir,
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
