""""this machine", measured: what the CPU lab's ranks compute per second and what a blocking
collective costs them when they outnumber the cores.

Three measurements, none of them a run the planner is then checked against:

- ``compute``: the lab GPT's forward and backward in this process on one thread, at two batch
  sizes. The time is a fixed part per layer (Python, the dispatcher, the small kernels that do
  not grow with the batch) plus FLOPs over a rate; two sizes give both (``Cluster.peak`` with
  ``matmul_efficiency`` 1, and ``Cluster.layer_overhead``). Ranks beyond the cores share them
  evenly (``world / cores`` times the time alone).
- the link: the alpha-beta fit of ``python -m dlab bench allreduce`` (``cluster.fitted_link``).
- ``collective_probe``: with more ranks than cores, a collective is not a message on a wire but
  a chain of hand-offs between processes that take turns on the cores: each ring step waits
  for the next rank to be scheduled, and the waiting ranks burn core time too (a 4 KiB
  all-reduce over 4 ranks on 2 cores costs each rank about 2 ms of CPU, ``time.process_time``,
  and 6 ms of wall time: 50 times its wire time). No link model predicts that, so the probe
  measures it: every rank in a group of g consecutive ranks (each g dividing the world), every
  group at once, each rank alternating a piece of compute (about a layer's share, 1.4 ms alone)
  with one call, for each op the lab uses (all-reduce, all-gather, reduce-scatter, a ring pass
  of send and receive) at two payloads; a call costs the round less the compute's even share
  of the cores. ``Cluster.calls`` keeps a fixed part and a part per byte per (op, g); the
  planner charges every blocking collective of a step with it (``time.collective_calls``
  counts them).

What none of them sees, and the bench shows as error: the lab's own bookkeeping per step
(meters, the timeline, the optimizer's Python); a pipeline, whose idle stages leave the cores
to the busy ones, so that its collectives meet fewer competitors than the probe's (pipelines
with tensor parallelism read up to a third or more too slow); and the probe's own spread from
run to run (a ring pass at 4 ranks measured 0.8-2 ms on different runs).
"""
from __future__ import annotations

import os
import statistics
import time

import dlab
from dlab.plan import cluster as clusters


def _step_seconds(cfg, batch: int, repeats: int) -> float:
    import torch

    from dlab.models.gpt import GPT
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def compute(cfg, small: int = 1, large: int = 8, repeats: int = 5) -> tuple[float, float]:
    """(FLOP/s, seconds per layer of fixed cost) of one thread on the lab GPT ``cfg``, in this
    process. (Measured with every rank busy at once instead, the two-size fit swung by 2x from
    run to run on 2 oversubscribed cores; one process alone is repeatable.)"""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t_small, t_large = (_step_seconds(cfg, b, repeats) for b in (small, large))
    finally:
        torch.set_num_threads(threads)
    flops = cfg.hardware_flops_per_token() * cfg.seq_len
    rate = flops * (large - small) / max(t_large - t_small, 1e-9)
    fixed = max(t_small - flops * small / rate, 0.0)
    return rate, fixed / cfg.n_layer


PROBE_SIZES = (16 << 10, 1 << 20)  # payload bytes: a norm's gradient to a layer's activations
OPS = ("all_reduce", "all_gather", "reduce_scatter", "ring")


def _work(a, work: int):
    import torch
    for _ in range(work):
        a = torch.tanh(a @ a)
    return a


def _work_seconds(work: int, repeats: int = 20) -> float:
    """A piece of compute's seconds in this process alone, on one thread."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(128, 128) / 128
        start = time.perf_counter()
        for _ in range(repeats):
            a = _work(a, work)
        return (time.perf_counter() - start) / repeats
    finally:
        torch.set_num_threads(threads)


def _call(op: str, x, buf, group, ring: tuple[int, int], a, work: int):
    """One blocking collective of kind ``op`` on ``group`` whose whole buffer is ``x`` (an
    all-gather's output, a reduce-scatter's input), after ``work`` pieces of compute; ``ring``:
    send ``x`` to one neighbour and receive one from the other at once, one pass of ring
    attention (whose blocks of the lab's sizes compute in far less time than a pass takes)."""
    import torch.distributed as dist
    shard = x.numel() // dist.get_world_size(group)
    a = _work(a, work)
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(x, buf[:shard], group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(buf[:shard], x, group=group)
    else:
        for handle in (dist.isend(x, ring[0]), dist.irecv(buf, ring[1])):
            handle.wait()
    return a


def _collective_rounds(repeats: int, work: int, trials_: int) -> dict:
    """Seconds per round (a piece of compute, then a call) of every op on groups of every size
    that divides the world, every rank in a group of that size (consecutive ranks, as ``nd``
    lays out its fastest dimensions): the median of ``trials_`` runs of ``repeats`` rounds
    (the cores' sharing swings from one run to the next)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    a = torch.randn(128, 128) / 128
    out = {}
    for g in [d for d in range(2, world + 1) if world % d == 0]:
        groups = [dist.new_group(list(range(s, s + g))) for s in range(0, world, g)]
        base = rank - rank % g
        ring = (base + (rank + 1) % g, base + (rank - 1) % g)
        for size in PROBE_SIZES:
            x, buf = torch.zeros(size // 4), torch.zeros(size // 4)
            for op in OPS:
                a = _call(op, x, buf, groups[rank // g], ring, a, work)
                trials = []
                for _ in range(trials_):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(repeats):
                        a = _call(op, x, buf, groups[rank // g], ring, a, work)
                    trials.append((time.perf_counter() - start) / repeats)
                out[(op, g, size)] = statistics.median(trials)
    return out


def collective_probe(world: int, work: int = 16, repeats: int = 20, trials: int = 5,
                     runs_dir: str = "runs") -> tuple:
    """``Cluster.calls`` at ``world`` ranks: per (op, group size), the fixed seconds and the
    seconds per payload byte of one blocking collective, fitted through two payloads. Each
    rank alternates ``work`` pieces of compute (about a layer's share, 1-2 ms alone) with the
    call, as a step does, and the call costs the round (the slowest rank's mean) less the
    compute's even share of the cores. Empty when every rank has a core: then the alpha-beta
    link describes a collective."""
    cores = os.cpu_count() or 1
    if world <= cores:
        return ()
    share = _work_seconds(work) * world / cores
    per_rank = dlab.spawn(_collective_rounds, world, repeats, work, trials, runs_dir=runs_dir)
    small, large = PROBE_SIZES
    rows = []
    for op, g, size in per_rank[0]:
        if size != small:
            continue
        t_small, t_large = (max(r[(op, g, s)] for r in per_rank) - share for s in (small, large))
        slope = max(t_large - t_small, 0.0) / (large - small)
        rows.append((op, g, max(t_small - slope * small, 0.0), slope))
    return tuple(rows)


def this_machine(cfg, world: int, runs_dir: str = "runs") -> clusters.Cluster:
    """The CPU machine preset for the lab GPT ``cfg`` at ``world`` ranks, every constant measured."""
    rate, overhead = compute(cfg)
    return clusters.this_machine(peak=rate, ranks=world, layer_overhead=overhead,
                                 calls=collective_probe(world, runs_dir=runs_dir))
