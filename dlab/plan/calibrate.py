""""this machine", measured: what the CPU lab's ranks compute per second and what a blocking
collective costs them when they outnumber the cores.

Three probes, none of them a run the planner is then checked against:

- ``compute``: the lab GPT's forward and backward in this process on one thread, at two batch
  sizes. The time is a fixed part per layer (Python, the dispatcher, the small kernels that do
  not grow with the batch) plus FLOPs over a rate; two sizes give both (``Cluster.peak`` with
  ``matmul_efficiency`` 1, and ``Cluster.layer_overhead``). Ranks beyond the cores share them
  evenly (``world / cores`` times the time alone).
- the link: the alpha-beta fit of ``python -m dlab bench allreduce`` (``cluster.fitted_link``).
- ``sync_probe``: with more ranks than cores, a rank that reaches a collective first sleeps
  until its peers are scheduled again. The probe runs ranks that alternate a fixed piece of
  compute (about 5 ms alone) with a one-float all-reduce and reports what a round costs beyond
  the compute's even share and the link's latency: ``Cluster.sync``, paid once per blocking
  collective (3-7 ms at 4 and 8 ranks on 2 cores).

What none of them sees, and the bench shows as error: the lab's own bookkeeping around every
collective and saved tensor (the wire meter, the timeline, the activation meter), and how much
worse than an even share the cores are divided when 4 or 8 ranks meet dozens of times a step.
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


def sync_probe(world: int, work: int = 40, rounds: int = 60, runs_dir: str = "runs") -> float:
    """Seconds a blocking round costs beyond the compute's even share of the cores, at
    ``world`` ranks (0 when every rank has a core)."""
    cores = os.cpu_count() or 1
    if world <= cores:
        return 0.0
    alone = _work_seconds(work)
    per_round = max(dlab.spawn(_sync_rounds, world, work, rounds, runs_dir=runs_dir))
    link = clusters.fitted_link(world)
    return max(per_round - alone * world / cores - 2 * (world - 1) * link.alpha, 0.0)


def this_machine(cfg, world: int, runs_dir: str = "runs") -> clusters.Cluster:
    """The CPU machine preset for the lab GPT ``cfg`` at ``world`` ranks, every constant measured."""
    rate, overhead = compute(cfg)
    return clusters.this_machine(peak=rate, ranks=world, layer_overhead=overhead,
                                 sync=sync_probe(world, runs_dir=runs_dir))
