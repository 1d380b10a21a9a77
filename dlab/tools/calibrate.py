""""this machine", measured: what the CPU lab's ranks' work costs them in CPU seconds, and how
much of the cores' time they fill when they outnumber the cores.

Three measurements, none of them a run the planner is then checked against:

- ``compute``: the lab GPT's forward and backward on one thread at four batch sizes (a rate
  and a fixed part per layer), and one tile of ring attention at three sizes (a fixed part and
  a part per element); with more ranks than cores every rank measures at once.
- the link: the alpha-beta fit of ``python -m dlab bench allreduce`` (``cluster.fitted_link``),
  which describes a collective where every rank has a core.
- ``collective_probe``: with more ranks than cores, a collective is not a message on a wire but
  a chain of hand-offs between processes that take turns on the cores, each one waking Gloo's
  threads: a 16 KiB all-reduce over 4 ranks on 2 cores burns about 1.6 ms of each rank's CPU,
  some ten times its time on the fitted link, whatever its bytes. No link model predicts that, so the probe
  measures it through dlab's own ``Comm``, every rank in a group of g consecutive ranks (each g
  dividing the world), every group at once, each rank alternating a piece of compute (about a
  layer's share, 1.3 ms alone) with one call, for each op the lab uses (all-reduce, all-gather,
  reduce-scatter, a ring pass of send and receive) at two payloads: the CPU seconds a call
  costs a rank (``Cluster.calls``), and the share of the cores' time the ranks fill
  (``Cluster.utilization``, about 0.85 at 4 ranks on 2 cores and 0.9 at 8).

The planner then counts what a step does (``dlab.theory.plan.cpu``) and shares the ranks' CPU seconds
out over the cores. What none of this sees, and the bench shows as error: the lab's own
bookkeeping per step and per micro-batch (the schedule, the meters, the timeline, the
optimizer's Python), and the CPU a rank burns while it waits, which grows with the wait.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from dlab.comm.instrumented import Comm
from dlab.core.machine import usable_cores
from dlab.models.gpt import GPT
from dlab.parallel.context.attention import Ring, ring_attention
from dlab.procs.spawn import spawn
from dlab.theory.plan import cluster as clusters


def _cpu_seconds(fn, repeats: int, clock=time.process_time) -> float:
    """Median seconds of ``fn()`` on ``clock`` over ``repeats`` calls after one to warm up. CPU
    time by default (``time.process_time``), not wall time: where ranks share the cores a
    rank's wall time is mostly the others' turns, while the CPU its work burns is its own (a
    little more than alone: the caches are shared too), and repeats to a few per cent."""
    times = []
    for _ in range(repeats + 1):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times[1:])


def _gpt_step(cfg, batch: int):
    import torch

    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))

    def step():
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return step


def _ring_tiles(cfg, b: int, heads: int, k: int):
    """ring attention's forward and backward on a one-rank ring whose tokens are two chunks of
    k (three visible tiles), and the tile count."""
    import types

    import torch

    chunks = torch.cat([torch.arange(k), torch.arange(2 * k, 3 * k)])
    ring = Ring(types.SimpleNamespace(rank=0, size=1), [chunks])
    q, key, v = (torch.randn(b, heads, 2 * k, cfg.d_model // cfg.n_head, requires_grad=True)
                 for _ in range(3))
    return (lambda: ring_attention(q, key, v, ring).sum().backward()), len(ring.tiles[0])


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through ``points``, neither below 0."""
    xs, ys = zip(*points)
    slope = max(statistics.linear_regression(xs, ys).slope, 0.0)
    return max(statistics.fmean(ys) - slope * statistics.fmean(xs), 0.0), slope


def _costs(cfg, repeats: int = 5, batches=(1, 2, 4, 8)) -> tuple[float, float, float, float]:
    """This process's (FLOP/s, fixed seconds per layer, fixed seconds per ring-attention tile,
    seconds per tile query element) on one thread (``compute``)."""
    import torch
    import torch.distributed as dist

    def together():  # on several ranks, each measurement starts on all of them at once
        if dist.is_initialized():
            dist.barrier()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    width = cfg.d_model // cfg.n_head
    steps, tiles = [], []
    try:
        for b in batches:
            together()
            steps.append((b, _cpu_seconds(_gpt_step(cfg, b), repeats)))
        for b, heads, k in ((1, 1, 4), (1, cfg.n_head, cfg.seq_len // 8),
                            (batches[-1], cfg.n_head, cfg.seq_len // 4)):
            fn, n = _ring_tiles(cfg, b, heads, max(k, 4))
            together()
            tiles.append((b * heads * max(k, 4) * width, _cpu_seconds(fn, 2 * repeats) / n))
    finally:
        torch.set_num_threads(threads)
    fixed, per_sequence = _line(steps)
    return (cfg.hardware_flops_per_token() * cfg.seq_len / max(per_sequence, 1e-9),
            fixed / cfg.n_layer, *_line(tiles))


def compute(cfg, world: int = 1, runs_dir: str = "runs") -> tuple[float, float, tuple[float, float]]:
    """What the lab GPT ``cfg``'s compute costs one thread in CPU seconds: (FLOP/s, fixed
    seconds per layer, ``ring_tile``). Two measurements, each a least-squares line through a
    few sizes: the GPT's forward and backward at batch 1, 2, 4 and 8 (its FLOPs over a rate
    plus a fixed part per layer: Python, the dispatcher, the small kernels that do not grow
    with the batch), and one tile of ring attention (``dlab.parallel.context.attention``), the
    core context parallelism puts in place of the fused attention: a dozen small ops per
    (query chunk, key chunk) tile, whose fixed cost dwarfs its FLOPs at the lab's sizes; timed
    from the smallest tile to the largest of ``cfg`` (one sequence and head, k = 4, to batch 8,
    every head, k = seq_len / 4), per element of the tile's queries, b x heads x k x head width.

    With more ``world`` ranks than cores, every rank measures at once and the ranks' mean is
    taken: sharing the cores (and their caches) makes the same work cost each rank some 5-15 %
    more CPU than alone. Otherwise this process measures alone."""
    if world <= usable_cores():
        rate, fixed, tile, per_element = _costs(cfg)
    else:
        rate, fixed, tile, per_element = (statistics.fmean(col) for col in
                                          zip(*spawn(_costs, world, cfg, runs_dir=runs_dir)))
    return rate, fixed, (tile, per_element)


PROBE_SIZES = (16 << 10, 1 << 20)  # payload bytes: a norm's gradient to a layer's activations
OPS = ("all_reduce", "all_gather", "reduce_scatter", "ring")


def _work(a, work: int):
    import torch
    for _ in range(work):
        a = torch.tanh(a @ a)
    return a


def _work_seconds(work: int, clock=time.process_time, repeats: int = 20) -> float:
    """A piece of compute's seconds on ``clock`` in this process alone, on one thread."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(128, 128) / 128
        return _cpu_seconds(lambda: _work(a, work), repeats, clock)
    finally:
        torch.set_num_threads(threads)


def _call(op: str, x, buf, comm, a, work: int):
    """One blocking collective of kind ``op`` through ``comm`` (dlab's instrumented ``Comm``, as
    the runs call them: its bookkeeping is part of a call's cost) whose whole buffer is ``x``
    (an all-gather's output, a reduce-scatter's input), after ``work`` pieces of compute;
    ``ring``: one pass of ring attention, which posts the send of ``x`` to the next rank of the
    group and the receive from the previous, computes while they fly, then waits for both."""
    shard = x.numel() // comm.size
    if op == "ring":
        handles = (comm.isend(x, (comm.rank + 1) % comm.size),
                   comm.irecv(buf, (comm.rank - 1) % comm.size))
        a = _work(a, work)
        for handle in handles:
            handle.wait()
        return a
    a = _work(a, work)
    if op == "all_reduce":
        comm.all_reduce(x)
    elif op == "all_gather":
        comm.all_gather_into_tensor(x, buf[:shard])
    else:
        comm.reduce_scatter_tensor(buf[:shard], x)
    return a


def _collective_rounds(repeats: int, work: int, trials_: int) -> dict:
    """(wall seconds, this process's CPU seconds) per round (a piece of compute, then a call) of
    every op on groups of every size that divides the world, every rank in a group of that size
    (consecutive ranks, as ``nd`` lays out its fastest dimensions): the median of ``trials_``
    runs of ``repeats`` rounds, the trials taken in turn over every op and group (how the
    scheduler pairs ranks with cores drifts over seconds; a run of trials back to back would
    see one pairing). CPU time is ``time.process_time``: every thread of the rank, Gloo's own
    included."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    a = torch.randn(128, 128) / 128
    comms = {g: Comm([dist.new_group(list(range(s, s + g))) for s in range(0, world, g)][rank // g])
             for g in range(2, world + 1) if world % g == 0}
    buffers = {size: (torch.zeros(size // 4), torch.zeros(size // 4)) for size in PROBE_SIZES}
    keys = [(op, g, size) for g in comms for size in PROBE_SIZES for op in OPS]
    for op, g, size in keys:  # warm up: Gloo makes its connections on first use
        a = _call(op, *buffers[size], comms[g], a, work)
    trials = {key: [] for key in keys}
    for _ in range(trials_):
        for op, g, size in keys:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(repeats):
                a = _call(op, *buffers[size], comms[g], a, work)
            trials[(op, g, size)].append(((time.perf_counter() - start) / repeats,
                                          (time.process_time() - cpu) / repeats))
    return {key: tuple(statistics.median(t[i] for t in got) for i in (0, 1))
            for key, got in trials.items()}


@dataclass(frozen=True)
class Probe:
    """What ``collective_probe`` measured at one world size: ``calls``, per (op, group size),
    what one blocking collective costs a rank, fixed and per payload byte (``Cluster.calls``);
    ``utilization``, the share of the cores' time the ranks' CPU filled where they outnumber
    the cores (``Cluster.utilization``; 1 where each rank has a core, and unused)."""
    calls: tuple = ()
    utilization: float = 1.0


def collective_probe(world: int, work: int = 16, repeats: int = 20, trials: int = 7,
                     runs_dir: str = "runs") -> Probe:
    """What a blocking collective costs each of ``world`` ranks, and how much of the cores' time
    the ranks fill while they alternate compute with collectives.

    Every rank alternates ``work`` pieces of compute (about a layer's share, 1.3 ms alone) with
    one call, as a step does, and a call costs a round less its compute alone, fitted through
    the two payloads. What a round is measured in depends on who owns the cores:

    - ranks outnumber the cores: CPU seconds. A rank's wall time is then mostly other ranks'
      turns (and depends on how many there are), while the CPU a call burns is its own: Gloo's
      threads hand the bytes over, wake and poll, and the compute after the call runs on caches
      the other ranks' work has just evicted (the thread's own CPU clock put a 1.3 ms piece at
      0.1-0.3 ms more in the rounds than alone, at 8 ranks on 2 cores): the call's doing too.
      The planner shares the ranks' CPU seconds out over the cores.
    - each rank has a core: wall seconds, the slowest rank's. A rank's time is its own, and a
      call's is how long it waits for its partners and Gloo's threads (some twice its CPU).

    Either way the cost is that of hand-offs between processes, not bytes: a 16 KiB all-reduce
    over 4 ranks on 2 cores burns about 1.6 ms of each rank's CPU, some 10 times its time on the
    fitted link. The utilization, where ranks outnumber the cores, is the ranks' CPU over the
    cores' time in the rounds, sum over ranks / (cores x wall): below 1 where a hand-off leaves
    a core with no rank ready to run; the median over every op, group and payload, at most 1."""
    cores = usable_cores()
    shared = world > cores
    alone = _work_seconds(work, time.process_time if shared else time.perf_counter)
    per_rank = spawn(_collective_rounds, world, repeats, work, trials, runs_dir=runs_dir)
    small, large = PROBE_SIZES
    rows, fills = [], []
    rounds = {}
    for key in per_rank[0]:
        wall = max(r[key][0] for r in per_rank)
        cpu = statistics.fmean(r[key][1] for r in per_rank)
        rounds[key] = (wall, cpu)
        fills.append(world * cpu / (cores * wall))
    for op, g, size in rounds:
        if size != small:
            continue
        c_small, c_large = (rounds[(op, g, s)][1 if shared else 0] - alone for s in (small, large))
        slope = max(c_large - c_small, 0.0) / (large - small)
        rows.append((op, g, max(c_small - slope * small, 0.0), slope))
    # the ranks cannot fill more than all of the cores' time: a median above 1 is the skew
    # between the ranks' clocks (each rank's medians are of its own rounds)
    return Probe(tuple(rows), min(statistics.median(fills), 1.0) if shared else 1.0)


def this_machine(cfg, world: int, runs_dir: str = "runs") -> clusters.Cluster:
    """The CPU machine preset for the lab GPT ``cfg`` at ``world`` ranks, every constant measured."""
    rate, overhead, tile = compute(cfg, world, runs_dir=runs_dir)
    probe = collective_probe(world, runs_dir=runs_dir)
    return clusters.this_machine(peak=rate, ranks=world, layer_overhead=overhead, ring_tile=tile,
                                 calls=probe.calls, utilization=probe.utilization)
