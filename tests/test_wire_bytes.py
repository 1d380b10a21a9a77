"""Measured wire bytes (``dlab.comm.wire``: the process's ``wchar``) against what Gloo's real
algorithms send, and against what dlab's hand-written algorithms count, at 2 and 4 ranks.

The Gloo formulas (``dlab.comm.gloo``) come from gloo's source: payload as the
algorithm moves it, plus 96 bytes per message sent and 48 per message received (the tcp
transport's preambles). Sizes: 4 KiB and 4 MiB split evenly into Gloo's segments (2N segments
of S/2N, and 1 MiB or 512 KiB segments); 4004 bytes does not (its last segments are short or
empty at 4 ranks), and the formula, which walks Gloo's segments, is exact there too.
"""
from __future__ import annotations

import functools
import math
import os

import pytest

import dlab

EVEN = (4096, 4 << 20)
UNEVEN = (4004,)


def _measure(comm, op: str, fn, *args, **kwargs):
    """(the bytes measured on the wire for ``fn(*args)``, booked under ``op``; what fn returned)"""
    before = comm.stats[op].wire_bytes or 0
    out = fn(*args, **kwargs)
    return comm.stats[op].wire_bytes - before, out


def _wire(comm, op: str, fn, *args, **kwargs) -> int:
    return _measure(comm, op, fn, *args, **kwargs)[0]


def backend_cases() -> dict:
    import torch
    import torch.distributed as dist

    from dlab.comm import gloo as model
    from dlab.comm.instrumented import Comm

    comm, n, r = Comm(), dist.get_world_size(), dist.get_rank()
    got = {}
    for s in EVEN + UNEVEN:
        x = torch.ones(s // 4)
        got["all_reduce", s] = (_wire(comm, "all_reduce", comm.all_reduce, x),
                                model.gloo_all_reduce_bytes(s, n, r))
        xs = torch.ones(s // 4 // n * n)
        out = torch.empty(xs.numel() // n)
        got["reduce_scatter", s] = (
            _wire(comm, "reduce_scatter", comm.reduce_scatter_tensor, out, xs),
            model.gloo_reduce_scatter_bytes(xs.numel() * 4, n, r))
        got["all_reduce_same_input", s] = (
            _wire(comm, "all_reduce", comm.all_reduce, xs.clone()),
            model.gloo_all_reduce_bytes(xs.numel() * 4, n, r))
        gathered = torch.empty(xs.numel())
        got["all_gather", s] = (
            _wire(comm, "all_gather", comm.all_gather_into_tensor, gathered, out),
            model.gloo_all_gather_bytes(xs.numel() * 4, n))
        for root in range(n):
            got["broadcast", s, root] = (
                _wire(comm, "broadcast", comm.broadcast, x, root),
                model.gloo_broadcast_bytes(s, n, r, root))
        y = torch.empty_like(xs)
        got["all_to_all", s] = (
            _wire(comm, "all_to_all", comm.all_to_all_single, y, xs),
            model.gloo_all_to_all_bytes(xs.numel() * 4 // n * (n - 1), n))
        peer = r ^ 1  # pairs (0, 1), (2, 3)
        if r % 2 == 0:
            got["send", s] = (_wire(comm, "send", comm.send, x, peer), model.gloo_send_bytes(s))
        else:
            got["recv", s] = (_wire(comm, "recv", comm.recv, x, peer), model.gloo_recv_bytes())
    # uneven all_to_all: rank r sends (r + j) % 3 rows of 5 floats to rank j
    splits = [(r + j) % 3 for j in range(n)]
    counts = torch.tensor(splits)
    everyone = [torch.empty_like(counts) for _ in range(n)]
    dist.all_gather(everyone, counts)
    out_splits = [int(e[r]) for e in everyone]
    inp, res = torch.ones(sum(splits), 5), torch.empty(sum(out_splits), 5)
    got["all_to_all_uneven"] = (
        _wire(comm, "all_to_all", comm.all_to_all_single, res, inp, out_splits, splits),
        model.gloo_all_to_all_bytes((sum(splits) - splits[r]) * 20, n))
    return got


def algorithm_cases() -> dict:
    """dlab's hand-written algorithms: their own count plus Gloo's framing, against the wire."""
    import torch

    from dlab.comm import gloo as model
    from dlab.comm.algorithms import ALGORITHMS
    from dlab.comm.algorithms.collectives import all_gather, all_to_all, broadcast, reduce_scatter
    from dlab.comm.instrumented import Comm

    comm = Comm()
    n, got = comm.size, {}

    def framed(report):
        return report.message_bytes + model.gloo_framing(report.sent_pieces, report.recv_pieces)

    numel = (5 << 20) // 8  # 2.5 MiB: several 1 MiB pieces for the tree, one per ring chunk
    for name, fn in ALGORITHMS.items():
        x = torch.ones(numel)
        if name == "shm":
            fn(x)  # the first call maps the buffers (two more barriers); measure a later one
        wire, report = _measure(comm, name, comm.run_algorithm, name, numel * 4, functools.partial(fn, x))
        got[name] = (wire, framed(report), report.sent_bytes)
        if name == "shm":  # the data goes through shared memory: on the wire only its three
            # dissemination barriers, ceil(log2 N) rounds of a 1-byte token each way
            got["shm's tokens"] = (report.message_bytes, 3 * math.ceil(math.log2(n)), 0)
    x = torch.ones(numel // n * n)
    out = torch.empty(numel // n)
    for name, call in {
        "reduce_scatter": functools.partial(reduce_scatter, out, x),
        "all_gather": functools.partial(all_gather, x, out),
        "broadcast": functools.partial(broadcast, x, src=1),
        "all_to_all": functools.partial(all_to_all, torch.empty_like(x), x),
    }.items():
        wire, report = _measure(comm, name, comm.run_algorithm, name, 0, call)
        got["collective " + name] = (wire, framed(report), report.sent_bytes)
    return got


def overlap_and_exclusion_cases(tmp: str) -> dict:
    """Busy periods of async ops, and a file-writing thread kept off the count."""
    import os
    import threading

    import torch

    from dlab.comm import gloo as model
    from dlab.comm.instrumented import Comm
    from dlab.comm.wire import meter

    comm = Comm()
    n, r, s = comm.size, comm.rank, 1 << 20
    ar = model.gloo_all_reduce_bytes(s, n, r)
    got = {}
    a, b = torch.ones(s // 4), torch.ones(s // 4)
    def both(first, second):
        for w in [first(), second()]:
            w.wait()

    got["two all_reduces in flight"] = (_wire(comm, "all_reduce", both,
                                              lambda: comm.all_reduce(a, async_op=True),
                                              lambda: comm.all_reduce(b, async_op=True)), 2 * ar)
    # Whether the all-gather is launched before the all-reduce completes is the scheduler's
    # choice (a loaded machine may finish the first before the second starts): the periods are
    # then booked to "overlapped:..." or to each op, and either way their sum is every byte.
    # How a mixed period is booked is test_a_mixed_busy_period_is_booked_whole_and_apart's.
    g = torch.empty(s // 4)
    entries = ("all_reduce", "all_gather", "overlapped:all_gather+all_reduce")
    before = {op: comm.stats[op].wire_bytes or 0 for op in entries}
    both(lambda: comm.all_reduce(a, async_op=True),
         lambda: comm.all_gather_into_tensor(g, b[:s // 4 // n], async_op=True))
    got["all_reduce + all_gather in flight"] = (
        sum((comm.stats[op].wire_bytes or 0) - before[op] for op in entries),
        ar + model.gloo_all_gather_bytes(s, n))

    def writer(path, rounds, registered):
        def body():
            with open(path, "wb") as f:
                for _ in range(rounds):
                    f.write(os.urandom(1 << 16))
                    f.flush()
                    os.fsync(f.fileno())
        if registered:
            with meter.off_wire():
                body()
        else:
            body()

    from dlab.comm.algorithms import ring_all_reduce

    for registered in (True, False):
        # a writer that outlives the window and one that ends inside it; the window is a
        # synchronous one around the whole call, so every file byte falls inside it
        threads = [threading.Thread(target=writer, args=(f"{tmp}/r{r}-{registered}-{i}", k, registered))
                   for i, k in enumerate((64, 2))]
        x = torch.ones(1 << 20)

        def call(threads=threads, x=x):
            for t in threads:
                t.start()
            threads[1].join()
            report = ring_all_reduce(x)
            threads[0].join()
            return report

        wire, rep = _measure(comm, "ring", comm.run_algorithm, "ring", 0, call)
        got["file writer", registered] = (
            wire, rep.sent_bytes + model.gloo_framing(rep.sent_pieces, rep.recv_pieces)
            + (0 if registered else 66 << 16))
    return got


@pytest.mark.parametrize("world_size", [2, 4])
def test_backend_collectives_write_what_gloo_algorithms_send(world_size, runs_dir):
    ranks = dlab.spawn(backend_cases, world_size, runs_dir=runs_dir, timeout_s=120)
    for r, got in enumerate(ranks):
        for case, (wire, gloo) in got.items():
            assert wire == gloo, f"rank {r} {case}: measured {wire} B, Gloo's algorithm {gloo} B"
    n = world_size
    for got in ranks:  # the facts, on measured figures alone
        for s in EVEN:
            rs, ar = got["reduce_scatter", s][0], got["all_reduce_same_input", s][0]
            assert rs == ar, "Gloo's reduce-scatter writes a whole all-reduce"
    if n == 4:
        s = 4 << 20
        payload = [got["broadcast", s, 0][0] for got in ranks]
        framing = [2 * 96 + 48 * 0, 96 + 48, 48, 48]
        assert [p - f for p, f in zip(payload, framing, strict=True)] == [2 * s, s, 0, 0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_hand_written_algorithms_counts_are_their_wire(world_size, runs_dir):
    ranks = dlab.spawn(algorithm_cases, world_size, runs_dir=runs_dir, timeout_s=120)
    for r, got in enumerate(ranks):
        for case, (wire, expected, _) in got.items():
            assert wire == expected, f"rank {r} {case}: measured {wire} B, counted {expected} B"


@pytest.mark.parametrize("world_size", [2, 4])
def test_busy_periods_and_off_wire_threads(world_size, runs_dir, tmp_path):
    ranks = dlab.spawn(overlap_and_exclusion_cases, world_size, str(tmp_path),
                       runs_dir=runs_dir, timeout_s=120)
    for r, got in enumerate(ranks):
        for case, (wire, gloo) in got.items():
            # ("file writer", False) is the control: not registered, its 66 x 64 KiB count too
            assert wire == gloo, f"rank {r} {case}: measured {wire} B, expected {gloo} B"


class _FakeComm:
    """What the meter needs of a ``Comm``: its stats by op."""

    def __init__(self):
        from collections import defaultdict

        from dlab.comm.instrumented import OpStats
        self.stats = defaultdict(OpStats)


def test_a_mixed_busy_period_is_booked_whole_and_apart():
    """The meter's booking, with the order of launches and completions chosen here rather than
    by Gloo's threads: bytes written while ops are in flight (to /dev/null: ``wchar`` counts
    every write) go whole to the one op of a period, or to "overlapped:<ops>" when a period
    mixes ops or ``Comm``s; a period that closes before the next op starts is booked alone."""
    from dlab.comm.wire import WireMeter

    meter = WireMeter()
    if not meter.available:
        pytest.skip("no /proc/self/io on this system")
    one, other = _FakeComm(), _FakeComm()
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        def write(n):
            os.write(fd, b"x" * n)

        a = meter.begin(one, "all_reduce", one.stats["all_reduce"])
        write(100)
        b = meter.begin(one, "all_gather", one.stats["all_gather"])  # a in flight: one period
        write(20)
        meter.end(a)
        write(3)
        meter.end(b)
        assert one.stats["overlapped:all_gather+all_reduce"].wire_bytes == 123
        assert one.stats["all_reduce"].wire_bytes is None and one.stats["all_gather"].wire_bytes is None
        c = meter.begin(one, "all_reduce", one.stats["all_reduce"])
        write(7)
        meter.end(c)  # closed before d starts: two periods, each its own op
        d = meter.begin(one, "all_gather", one.stats["all_gather"])
        write(5)
        meter.end(d)
        assert (one.stats["all_reduce"].wire_bytes, one.stats["all_gather"].wire_bytes) == (7, 5)
        e = meter.begin(one, "all_reduce", one.stats["all_reduce"])  # the same op on two Comms
        f = meter.begin(other, "all_reduce", other.stats["all_reduce"])
        write(11)
        meter.end(f)
        meter.end(e)
        assert one.stats["overlapped:all_reduce"].wire_bytes == 11  # on the Comm that opened it
        assert not other.stats["overlapped:all_reduce"].wire_bytes
        g = meter.begin(one, "all_reduce", one.stats["all_reduce"])  # a step boundary inside it
        write(13)
        meter.cut()
        write(17)
        meter.end(g)
        assert one.stats["all_reduce"].wire_bytes == 7 + 13 + 17
    finally:
        os.close(fd)


def test_async_checkpoint_thread_stays_off_the_wire(runs_dir):
    """zero2 saving a checkpoint after every step from its writer thread, while the next step
    runs: every step's measured bytes are still exactly Gloo's for the step."""
    from dlab.theory.memory import model_units, zero_wire_bytes

    config = {"model": "gpt", "batch_size": 8, "steps": 4,
              "model_options": {"n_layer": 3, "d_model": 64, "n_head": 2, "seq_len": 32}}
    run = dlab.launch("zero2", 2, runs_dir=runs_dir, wait=True, checkpoint_every=1,
                      checkpoint_async=True, **config)
    units = model_units("gpt", config["model_options"])
    from dlab.comm import gloo as model
    for r in range(2):
        want = zero_wire_bytes(units, 2, r, 2) + model.gloo_all_reduce_bytes(4, 2, r)
        steps = run.metrics(r)
        assert len(steps) == 4 and all("checkpoint_s" in m for m in steps)
        assert [m["comm"]["wire_bytes"] for m in steps] == [want] * 4


def test_summary_names_the_figures_and_says_when_wire_is_not_measurable():
    from dlab.analysis.summary import NOT_MEASURABLE, Summary

    memory = {"parameters": 1, "gradients": 1, "optimizer": 1, "activations": 1}
    row = {"rank": 0, "steps": 2, "loss": 1.0, "first_step_s": 1.0, "step_time_s": 1.0,
           "tokens_per_s": 1.0, "mfu": 0.1, "memory": memory, "memory_total": 4,
           "comm_sent_per_step": 2 ** 20, "comm_wire_per_step": None,
           "comm_exposed_s_per_step": 0.1, "comm_busy_s_per_step": 0.1}
    text = str(Summary("nccl-run", "ok", [row]))
    assert "model comm MiB/step" in text and "wire MiB/step (measured)" in text
    assert NOT_MEASURABLE in text
    measured = str(Summary("gloo-run", "ok", [{**row, "comm_wire_per_step": 2 ** 21}]))
    assert NOT_MEASURABLE not in measured and "2.000" in measured
