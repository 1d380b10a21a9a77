""""this machine", measured: what the CPU lab's ranks compute per second and what a blocking
collective costs them when they outnumber the cores.

Three probes, none of them a run the planner is then checked against:

- ``compute``: the lab GPT's forward and backward in this process on one thread, at two batch
  sizes. The time is a fixed part per layer (Python, the dispatcher, the small kernels that do
  not grow with the batch) plus FLOPs over a rate; two sizes give both (``Cluster.peak`` with
  ``matmul_efficiency`` 1, and ``Cluster.layer_overhead``).
- the link: the alpha-beta fit of ``python -m dlab bench allreduce`` (``cluster.fitted_link``).
- ``sync_probe``: with more ranks than cores, ranks that must meet at every collective do not
  share the cores as evenly as free-running ones (a rank that reaches a collective first sleeps
  until its peers are scheduled, and the core it leaves is not always taken at once). The
  probe runs ranks that alternate a fixed piece of compute with a one-float all-reduce, at two
  amounts of compute: a round takes ``slowdown`` x the compute alone plus a fixed ``sync``
  (measured here: about 2.8 x and 2.5 ms at 4 ranks on 2 cores, where an even share would be
  2 x and nothing). ``Cluster.slowdown`` then stretches every rank's compute and ``sync`` is
  paid once per blocking collective.
"""
from __future__ import annotations

import dataclasses
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


def _concurrent_steps(cfg, batches: tuple[int, ...], repeats: int) -> list[float]:
    import torch
    torch.set_num_threads(1)
    return [_step_seconds(cfg, b, repeats) for b in batches]


def compute(cfg, world: int = 1, small: int = 1, large: int = 4, repeats: int = 5,
            runs_dir: str = "runs") -> tuple[float, float]:
    """(FLOP/s, seconds per layer of fixed cost) of one rank on the lab GPT ``cfg`` while
    ``world`` ranks compute at once (each its own forward and backward, no communication):
    what the cores, caches and memory bandwidth give each rank when all of them are busy."""
    if world == 1:
        t_small, t_large = _concurrent_steps(cfg, (small, large), repeats)
    else:
        per_rank = dlab.spawn(_concurrent_steps, world, cfg, (small, large), repeats, runs_dir=runs_dir)
        t_small, t_large = (max(r[i] for r in per_rank) for i in range(2))
    flops = cfg.hardware_flops_per_token() * cfg.seq_len
    rate = flops * (large - small) / max(t_large - t_small, 1e-9)
    fixed = max(t_small - flops * small / rate, 0.0)
    return rate, fixed / cfg.n_layer


def _sync_rounds(work: int, rounds: int) -> float:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    a, one = torch.randn(128, 128), torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        for _ in range(work):
            a = torch.tanh(a @ a)
        dist.all_reduce(one)
    return (time.perf_counter() - start) / rounds


def _work_seconds(work: int) -> float:
    import torch
    torch.set_num_threads(1)
    a = torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(work * 20):
        a = torch.tanh(a @ a)
    return (time.perf_counter() - start) / 20


def sync_probe(world: int, works=(10, 80), rounds: int = 40, runs_dir: str = "runs"
               ) -> tuple[float, float]:
    """(slowdown, seconds per round) of ``world`` ranks that alternate compute with a one-float
    all-reduce: a round takes slowdown x the compute alone plus the fixed wait, fitted over two
    amounts of compute. With no more ranks than cores: (1, 0)."""
    cores = os.cpu_count() or 1
    if world <= cores:
        return 1.0, 0.0
    alone = [_work_seconds(w) for w in works]
    per_round = [max(dlab.spawn(_sync_rounds, world, w, rounds, runs_dir=runs_dir)) for w in works]
    slope = (per_round[1] - per_round[0]) / (alone[1] - alone[0])
    return slope, max(per_round[0] - slope * alone[0], 0.0)


def this_machine(cfg, world: int, runs_dir: str = "runs") -> clusters.Cluster:
    """The CPU machine preset for the lab GPT ``cfg`` at ``world`` ranks, every constant measured."""
    rate, overhead = compute(cfg, world, runs_dir=runs_dir)
    _, sync = sync_probe(world, runs_dir=runs_dir)
    base = clusters.this_machine(peak=rate, ranks=world, layer_overhead=overhead)
    return dataclasses.replace(base, slowdown=1.0, sync=sync)
