"""Data parallelism: ps-sync, ps-async, dp-naive and ddp.

Parity: each trains exactly like ``single`` on the same global batch at 2 and 4 ranks (fp32,
1e-5 absolute: the ranks sum the same gradients in another order). Bytes: what each rank sent
and received per step equals ``dlab.theory.data_parallel``'s formula. One launch per
(strategy, options, world size) serves both checks, since launches are what costs here.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY_GPT, assert_ranks_agree, assert_same_training, final_state, losses, max_param_diff
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import dlab
from dlab.core.config import ConfigError, RunConfig
from dlab.core.events import Timeline
from dlab.models import model_config
from dlab.models.data import make_data, shard
from dlab.parallel.data_parallel.buckets import assign, build_buckets
from dlab.parallel.data_parallel.parameter_server import AsyncParameterServer
from dlab.theory import data_parallel as est
from dlab.theory.comm import AlphaBeta
from dlab.worker.validate import validate

CAP_MB = 0.02  # ~20 KiB: the tiny GPT's 136 KiB of gradients make several buckets
PARAM_BYTES = 4 * model_config("gpt", TINY_GPT["model_options"]).n_params()

CASES = {
    "ps-sync": ("ps-sync", {}),
    "dp-naive": ("dp-naive", {}),
    "ddp": ("ddp", {"bucket_cap_mb": CAP_MB}),
    "ddp-accumulate": ("ddp", {"bucket_cap_mb": CAP_MB, "accumulation": 2}),
    "ddp-ring": ("ddp", {"bucket_cap_mb": CAP_MB, "allreduce": "ring"}),
    "ps-async-bound0": ("ps-async", {"max_staleness": 0}),
    # the benches' peer: DDP's C++ all-reduce, bytes read from the buckets DDP reports
    "torch-ddp-builtin": ("torch-ddp", {"comm_hook": "builtin", "bucket_cap_mb": CAP_MB}),
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_and_moves_the_formula_bytes(case, world_size, runs_dir, reference):
    strategy, options = CASES[case]
    run = dlab.launch(strategy, world_size, runs_dir=runs_dir, wait=True, save_final=True,
                      options=options, **TINY_GPT)
    assert_same_training(run, reference(**TINY_GPT))
    ring = options.get("allreduce") == "ring"
    for rank in range(world_size):
        assert losses(run, rank) == losses(run, 0)
        want = est.bytes_per_step(strategy, PARAM_BYTES, world_size, rank)
        records = run.metrics(rank)
        if strategy == "ps-async":  # pulls are counted in the step that takes them: sum them
            sent = sum(m["comm"]["sent_bytes"] for m in records)
            recv = sum(m["comm"]["recv_bytes"] for m in records)
            assert (sent, recv) == (want["sent"] * len(records), want["recv"] * len(records))
            continue
        for m in records:
            # The hand-written ring cuts a bucket into chunks that differ by one element, so a
            # rank's bytes are 2 S - c_i - c_(i+1): within 8 bytes a bucket of the formula.
            tol = 8 * m["comm_by_op"]["all_reduce"]["calls"] if ring else 0
            assert abs(m["comm"]["sent_bytes"] - want["sent"]) <= tol, (rank, m["step"])
            assert abs(m["comm"]["recv_bytes"] - want["recv"]) <= tol, (rank, m["step"])
    if ring:  # ... and over all ranks those differences cancel: 2 (N-1) S in all, exactly
        for step in range(len(losses(run))):
            total = sum(run.metrics(r)[step]["comm"]["sent_bytes"] for r in range(world_size))
            assert total == 2 * (world_size - 1) * PARAM_BYTES


def test_ddp_launches_one_all_reduce_per_bucket_during_backward(runs_dir):
    """The overlap itself: each step has one all-reduce per predicted bucket, in bucket order,
    and the first starts (from its hook) before backward has finished; dp-naive's one call per
    tensor all start after it. A 4-layer model gives enough buckets to see it."""
    model = {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 32}
    cfg = {**TINY_GPT, "model_options": model, "steps": 2}
    sizes = [4 * p.numel() for p in dlab.models.build("gpt", model, 0).parameters()]
    n_buckets = len(est.bucket_sizes(sizes, int(CAP_MB * 2 ** 20)))
    assert n_buckets >= 4
    ddp = dlab.launch("ddp", 2, runs_dir=runs_dir, wait=True, options={"bucket_cap_mb": CAP_MB}, **cfg)
    naive = dlab.launch("dp-naive", 2, runs_dir=runs_dir, wait=True, **cfg)
    for run, count, overlaps in ((ddp, n_buckets, True), (naive, len(sizes), False)):
        for rank in (0, 1):
            events = run.timeline(rank)
            for step in (0, 1):
                ev = [e for e in events if e["step"] == step]
                backward = next(e for e in ev if e["kind"] == "backward")
                reduces = sorted((e for e in ev if e["kind"] == "all_reduce"), key=lambda e: e["start"])
                assert [e["bucket"] for e in reduces] == list(range(count))
                assert (reduces[0]["start"] < backward["end"]) is overlaps
            calls = [m["comm_by_op"]["all_reduce"]["calls"] for m in run.metrics(rank)]
            assert calls == [count, count]


def replay_ps_async(config: dict, staleness: list[list[int]]) -> tuple[list[float], dict]:
    """What ps-async should train, in one process: in round r worker w computes its gradient
    on the weights of version r - staleness[w][r] (as recorded on its timeline), the server
    averages the round's N gradients (its own first, then workers 1..N-1, as it sums them) and
    steps from version r to r + 1. Returns the mean loss of each round and the last version."""
    cfg = RunConfig.from_dict(config)
    n = cfg.world_size
    server = dlab.models.build(cfg.model, cfg.model_options, cfg.seed)
    worker = dlab.models.build(cfg.model, cfg.model_options, cfg.seed)
    optimizer = torch.optim.SGD(server.parameters(), lr=cfg.lr, momentum=0.9)
    versions = [parameters_to_vector(server.parameters()).detach().clone()]
    data, out = make_data(cfg), []
    for r in range(cfg.steps):
        batch, grads, round_losses = data.global_batch(r), [], []
        for w in range(n):
            vector_to_parameters(versions[r - staleness[w][r]].clone(), worker.parameters())
            worker.zero_grad()
            x, y = shard(batch, w, n)
            loss = worker.criterion(worker(x), y)
            loss.backward()
            grads.append(parameters_to_vector([p.grad for p in worker.parameters()]))
            round_losses.append(loss.item())
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        offset = 0
        for p in server.parameters():
            p.grad = (total / n)[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
        versions.append(parameters_to_vector(server.parameters()).detach().clone())
        out.append(sum(round_losses) / n)
    names = [k for k, _ in server.named_parameters()]
    return out, dict(zip(names, (p.detach() for p in server.parameters()), strict=True))


def test_ps_async_trains_what_its_recorded_staleness_says(runs_dir):
    """The staleness each worker records bounds as configured, and the training is exactly the
    one-process replay of that staleness (SGD, 1e-5): a worker that computed on other weights
    than it reported, or a server that applied a gradient twice or lost one, differs. The
    bytes pulled over the run are the formula's (ps-async counts a pull in the step that takes
    it, so only the sum is fixed)."""
    bound, steps = 1, 6
    run = dlab.launch("ps-async", 4, runs_dir=runs_dir, wait=True, save_final=True,
                      options={"max_staleness": bound}, **{**TINY_GPT, "steps": steps})
    staleness = []
    for rank in range(4):
        forward = [e for e in run.timeline(rank) if e["kind"] == "forward"]
        assert [e["step"] for e in forward] == list(range(steps))
        staleness.append([e["staleness"] for e in forward])
        limits = [min(bound, e["step"]) for e in forward]
        assert all(0 <= s <= m for s, m in zip(staleness[rank], limits, strict=True)), staleness
        want = est.bytes_per_step("ps-async", PARAM_BYTES, 4, rank)["recv"] * steps
        assert sum(m["comm"]["recv_bytes"] for m in run.metrics(rank)) == want
    assert staleness[0] == [0] * steps  # the server computes on the master weights
    want_losses, want_params = replay_ps_async(run.config, staleness)
    got = losses(run)
    assert max(abs(a - b) for a, b in zip(got, want_losses, strict=True)) <= 1e-5, (got, want_losses)
    diff, name = max_param_diff(final_state(run), want_params)
    assert diff <= 1e-5, (name, diff, staleness)
    assert_ranks_agree(run)


# --- no processes: buckets, formulas, config checks -------------------------------------------

class _CountingComm:
    def __init__(self):
        self.recorded = []

    def record(self, op, payload, sent, recv, seconds=0.0):
        self.recorded.append((op, recv))


class _CountedCondition(threading.Condition):
    """A condition that counts its waits and, at the first, starts ``on_wait`` in a thread: a
    delivery that comes while the worker waits, whatever the machine's load."""

    def __init__(self):
        super().__init__()
        self.waits, self.on_wait = 0, None

    def wait(self, timeout=None):
        self.waits += 1
        if self.waits == 1 and self.on_wait is not None:
            threading.Thread(target=self.on_wait).start()
        return super().wait(timeout)


def test_async_worker_waits_only_as_far_as_its_bound():
    """The bound's logic in one process: a worker takes what has arrived without waiting, waits
    only when it would be more than max_staleness rounds behind, and counts every version
    received (also the ones it skipped over) as one pull. Waiting is counted, not timed."""
    ps = AsyncParameterServer.__new__(AsyncParameterServer)
    ps.ctx = SimpleNamespace(comm=_CountingComm(), timeline=Timeline())
    ps.params = [torch.zeros(3)]
    ps.version, ps.newest, ps.arrived = 0, None, _CountedCondition()

    def deliver(version=2):
        with ps.arrived:
            ps.newest = (version, torch.full((3,), float(version)), ps.ctx.timeline.now())
            ps.arrived.notify_all()

    ps._take_newest(None)  # unbounded: nothing has arrived, go on with version 0
    ps._take_newest(0)  # bound satisfied already
    assert ps.version == 0 and ps.arrived.waits == 0
    ps.arrived.on_wait = deliver
    ps._take_newest(2)  # must wait for version 2 (versions 1 and 2 both came in)
    assert ps.arrived.waits >= 1
    assert ps.version == 2 and ps.params[0].tolist() == [2.0, 2.0, 2.0]
    assert [op for op, _ in ps.ctx.comm.recorded] == ["recv", "recv"]


def test_buckets_fill_in_reverse_and_grads_are_views():
    model = dlab.models.build("gpt", TINY_GPT["model_options"], 0)
    params = list(model.parameters())
    buckets = build_buckets(params, cap_bytes=20_000)
    assert [p for b in buckets for p in b.params] == params[::-1]
    for b in buckets:
        assert b.nbytes <= 20_000 or len(b.params) == 1
        for p in b.params:
            assert p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
    sizes = [4 * p.numel() for p in params]
    assert est.bucket_sizes(sizes, 20_000) == [b.nbytes for b in buckets]
    assert sum(b.nbytes for b in buckets) == PARAM_BYTES
    assert assign([5, 5, 20, 1], cap_bytes=10) == [[0, 1], [2], [3]]


def test_formulas():
    p = 1000.0
    assert est.bytes_per_step("ddp", p, 4) == {"sent": 1500.0, "recv": 1500.0}
    assert est.bytes_per_step("ps-sync", p, 4, rank=0)["sent"] == 3000.0
    assert est.bytes_per_step("ps-sync", p, 4, rank=3)["recv"] == 1000.0
    link = AlphaBeta(alpha=1e-3, beta=1e-9)
    # the same bytes in more messages cost more start-ups
    assert est.comm_time([p] * 10, 4, link) > est.comm_time([10 * p], 4, link)
    # one bucket cannot start before backward ends: all of it is exposed
    whole = est.exposed_comm_time([1e6], backward_s=0.1, world_size=4, link=link)
    assert whole == pytest.approx(est.comm_time([1e6], 4, link))
    assert est.exposed_comm_time([2.5e5] * 4, 0.1, 4, link) < whole
    with pytest.raises(ValueError, match="no data-parallel bytes formula"):
        est.bytes_per_step("tp", p, 2)


@pytest.mark.parametrize("strategy, options, batch, message", [
    ("ddp", {"bucket_cap_mb": 0}, 8, "bucket_cap_mb must be a positive"),
    ("ddp", {"accumulation": 3}, 8, "micro-batches of equal size"),
    ("ddp", {"allreduce": "tree"}, 8, "allreduce must be one of"),
    ("ddp", {"bucket": 1}, 8, "unknown option"),
    ("dp-naive", {}, 6, "does not split evenly over 4"),
    ("ps-sync", {"max_staleness": 1}, 8, "unknown option"),
    ("ps-async", {"max_staleness": -1}, 8, "max_staleness must be"),
])
def test_bad_configs_are_refused_before_start(strategy, options, batch, message):
    with pytest.raises(ConfigError, match=message):
        validate(RunConfig(strategy, world_size=4, batch_size=batch, options=options))


def test_tiny_gpt_parameter_bytes_are_what_the_formulas_use():
    model = dlab.models.build("gpt", TINY_GPT["model_options"], 0)
    assert sum(4 * p.numel() for p in model.parameters()) == PARAM_BYTES
    assert all(p.dtype == torch.float32 for p in model.parameters())
