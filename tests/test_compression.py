"""Gradient compression: ``ddp``'s ``compress`` methods and PyTorch's hooks (``torch-ddp``).

For each method, from one launch per (method, world size), shared by every check:

(a) bytes: each step's ``sent_bytes`` equal ``dlab.theory.compression``'s formula (ring
    convention), and the bytes measured on the wire equal its model of Gloo's algorithms;
(b) the rule: PowerSGD and top-k train exactly (fp32, 1e-5 on the parameters) like a
    one-process replay of the papers' rules over the N shards, written below as plain tensor
    operations (not from ``compression.py``);
(c) accuracy: the loss after the run stays within a stated tolerance of uncompressed data
    parallelism (the replay without compression, which ``ddp`` matches to 1e-5 in
    tests/test_data_parallel.py; the slow grid launches ``ddp`` itself);
(d) the peers, PyTorch's ``fp16_compress_hook``, ``bf16_compress_hook`` and ``powerSGD_hook``
    under ``torch-ddp``, send the formula's bytes; at 2 ranks dlab's fp16 takes the hook's steps
    exactly (cast, divide, sum of two: no rounding order to differ);
(e) options that cannot work are refused before any process starts.

The default run has every method and the PowerSGD peer at 2 ranks, launched together; the
slow tests add the fp16 peer at 2 ranks and repeat everything at 4 ranks with every peer and
``ddp`` itself.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
from helpers import TINY_GPT, assert_ranks_agree, final_state, losses, max_param_diff

import dlab
from dlab.core.config import ConfigError, RunConfig
from dlab.models.data import make_data, shard
from dlab.theory import compression as est
from dlab.worker.validate import validate

CAP_MB = 0.02  # ~20 KiB: the tiny GPT's 136 KiB of gradients make 7 buckets
CAP = int(CAP_MB * 2 ** 20)
CONFIG = {**TINY_GPT, "steps": 8, "save_final": True}
RANK, START, RATIO = 2, 2, 0.05  # rank 2: Gram-Schmidt's second column is exercised
SHAPES = [tuple(p.shape) for p in dlab.models.build("gpt", TINY_GPT["model_options"], 0).parameters()]

# name -> (strategy, options, the formula's method)
CASES = {
    "fp16": ("ddp", {"compress": "fp16"}, "fp16"),
    "bf16": ("ddp", {"compress": "bf16"}, "bf16"),
    "powersgd": ("ddp", {"compress": "powersgd", "powersgd_rank": RANK, "powersgd_start": START},
                 "powersgd"),
    "topk": ("ddp", {"compress": "topk", "topk_ratio": RATIO}, "topk"),
    "peer-fp16": ("torch-ddp", {"comm_hook": "fp16"}, "fp16"),
    "peer-bf16": ("torch-ddp", {"comm_hook": "bf16"}, "bf16"),
    "peer-powersgd": ("torch-ddp", {"comm_hook": "powersgd", "powersgd_rank": RANK,
                                    "powersgd_start": START}, "powersgd"),
    "none": ("ddp", {}, "none"),
}
DEFAULT = ("fp16", "bf16", "powersgd", "topk", "peer-powersgd")
MAX_RANKS = 12

# Final loss minus uncompressed data parallelism's, at most. The 8 SGD steps lower the loss by
# 0.16. fp16 keeps 11 significant bits of each gradient, bf16 8; measured within 1e-5 at 2 and
# 4 ranks, allowed 1e-4 and 1e-3. PowerSGD (rank 2) and top-k (5 % of the entries) send an
# approximation from step 2 on and error feedback sends the rest later, so they lag: measured
# 3e-3 and 5e-3 at 2 and 4 ranks (PyTorch's PowerSGD 2e-3); allowed 1e-2, 6 % of the run's
# progress. A missing /N moves the final loss by 0.1 (measured with one planted).
LOSS_TOL = {"fp16": 1e-4, "bf16": 1e-3, "powersgd": 1e-2, "topk": 1e-2}


def launch_all(names, world_size: int, runs_dir) -> dict[str, dlab.Run]:
    """The cases launched together (a launch is mostly start-up, which the others overlap), at
    most MAX_RANKS ranks at a time (~0.3 GB of memory each)."""
    runs: dict[str, dlab.Run] = {}
    in_flight: list[dlab.Run] = []
    for name in names:
        if (len(in_flight) + 1) * world_size > MAX_RANKS:
            in_flight.pop(0).wait(timeout=300)
        strategy, options, _ = CASES[name]
        runs[name] = dlab.launch(strategy, world_size, runs_dir=runs_dir, name=f"{name}-w{world_size}",
                                 options={"bucket_cap_mb": CAP_MB, **options}, **CONFIG)
        in_flight.append(runs[name])
    return {name: run.wait(timeout=300) for name, run in runs.items()}


@pytest.fixture(scope="module")
def runs2(tmp_path_factory):
    return launch_all(DEFAULT, 2, tmp_path_factory.mktemp("compression"))


# --- the papers' rules in one process, over the N shards ------------------------------------

def replay(world_size: int, rule) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Data-parallel SGD in one process: each step, the N shards' gradients g_i (a list per rank
    of one tensor per parameter) go to ``rule(step, grads)``, which returns the gradient every
    replica applies. Returns the mean loss of each step and the final parameters."""
    cfg = RunConfig("ddp", world_size=world_size, **CONFIG)
    model = dlab.models.build(cfg.model, cfg.model_options, cfg.seed)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    data, out = make_data(cfg), []
    for step in range(cfg.steps):
        batch, grads, step_losses = data.global_batch(step), [], []
        for i in range(world_size):
            model.zero_grad()
            x, y = shard(batch, i, world_size)
            loss = model.criterion(model(x), y)
            loss.backward()
            grads.append([p.grad.clone() for p in params])
            step_losses.append(loss.item())
        for p, g in zip(params, rule(step, grads)):
            p.grad = g
        optimizer.step()
        out.append(sum(step_losses) / world_size)
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def mean(grads: list[list[torch.Tensor]], j: int) -> torch.Tensor:
    return sum(g[j] for g in grads) / len(grads)


def uncompressed(step, grads):
    return [mean(grads, j) for j in range(len(grads[0]))]


class PowerSGDRule:
    """Vogels et al. 2019, Algorithm 1, with error feedback and warm start, for each matrix
    (``view(n, -1)``) that PyTorch's rule compresses ((n + m) r * 2 < n m): M_i = g_i + e_i,
    P = sum_i M_i Q, P orthonormalised, Q = mean_i M_i^T P, every replica applies P Q^T, and
    e_i = M_i - P Q^T. Vectors are averaged. Plain averaging before step ``start``. Q starts as
    N(0, 1) draws from one generator seeded with the run's seed, compressed parameters in
    registration order (dlab's convention). Orthonormalised by QR, which is the paper's
    Gram-Schmidt up to the sign of each column; P Q^T does not see the signs."""

    def __init__(self, shapes, world_size: int, rank: int, start: int, seed: int = 0):
        self.start, self.q, self.error = start, {}, [{} for _ in range(world_size)]
        generator = torch.Generator().manual_seed(seed)
        for j, shape in enumerate(shapes):
            n = shape[0]
            m = math.prod(shape) // n
            r = min(n, m, rank)
            if len(shape) >= 2 and (n + m) * r * 2 < n * m:
                self.q[j] = torch.randn(m, r, generator=generator)
                for e in self.error:
                    e[j] = torch.zeros(n, m)

    def __call__(self, step, grads):
        out = []
        for j in range(len(grads[0])):
            if step < self.start or j not in self.q:
                out.append(mean(grads, j))
                continue
            shape = grads[0][j].shape
            ms = [g[j].reshape(shape[0], -1) + e[j] for g, e in zip(grads, self.error)]
            p = torch.linalg.qr(sum(m @ self.q[j] for m in ms)).Q
            self.q[j] = sum(m.T @ p for m in ms) / len(ms)
            approx = p @ self.q[j].T
            for m, e in zip(ms, self.error):
                e[j] = m - approx
            out.append(approx.reshape(shape))
        return out


class TopKRule:
    """Stich et al. 2018 (sparsified SGD with memory) per ``ddp`` bucket: acc_i = e_i + g_i;
    rank i sends its k = round(ratio * numel) entries of largest |acc_i|; every replica applies
    the sum of the N sparse vectors / N; e_i = acc_i without the sent entries. Buckets as ``ddp``
    makes them: parameters in reverse registration order, a new bucket when the next would
    take the open one past the cap."""

    def __init__(self, shapes, world_size: int, ratio: float, cap_bytes: int):
        self.buckets: list[list[int]] = []
        filled = 0
        for j in reversed(range(len(shapes))):
            size = 4 * math.prod(shapes[j])
            if not self.buckets or filled + size > cap_bytes:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(j)
            filled += size
        self.ratio = ratio
        self.memory = [[torch.zeros(sum(math.prod(shapes[j]) for j in b)) for b in self.buckets]
                       for _ in range(world_size)]

    def __call__(self, step, grads):
        out = [None] * len(grads[0])
        for b, members in enumerate(self.buckets):
            numel = sum(grads[0][j].numel() for j in members)
            k = max(1, round(self.ratio * numel))
            dense = torch.zeros(numel)
            for i, g in enumerate(grads):
                acc = self.memory[i][b] + torch.cat([g[j].reshape(-1) for j in members])
                sent = acc.abs().topk(k).indices
                dense.index_add_(0, sent, acc[sent])
                acc[sent] = 0
                self.memory[i][b] = acc
            dense /= len(grads)
            at = 0
            for j in members:
                out[j] = dense[at:at + grads[0][j].numel()].view_as(grads[0][j])
                at += grads[0][j].numel()
        return out


def rule_of(name: str, world_size: int):
    if name == "powersgd":
        return PowerSGDRule(SHAPES, world_size, RANK, START)
    if name == "topk":
        return TopKRule(SHAPES, world_size, RATIO, CAP)
    return uncompressed


# --- the checks, shared by the default (2 ranks) and slow (4 ranks) tests -------------------

def check_bytes(run, method: str, dlab_counts_wire: bool) -> None:
    """(a), (d): every rank's bytes each step are the formula's."""
    n = run.world_size
    for rank in range(n):
        for m in run.metrics(rank):
            options = {"rank": RANK, "ratio": RATIO, "step": m["step"], "start": START}
            want = est.bytes_per_step(method, SHAPES, CAP, n, **options)
            assert m["comm"]["sent_bytes"] == pytest.approx(want, rel=1e-12), (method, rank, m["step"])
            assert m["comm"]["recv_bytes"] == pytest.approx(want, rel=1e-12), (method, rank, m["step"])
            if dlab_counts_wire and m["comm"]["wire_bytes"] is not None:
                op = "all_gather" if method == "topk" else "all_reduce"
                wire = est.gloo_bytes_per_step(method, SHAPES, CAP, n, rank, **options)
                assert m["comm_by_op"][op]["wire_bytes"] == wire, (method, rank, m["step"])


def check_rule(run, name: str) -> None:
    """(b): the run trained as the one-process replay of its rule."""
    want_losses, want_params = replay(run.world_size, rule_of(name, run.world_size))
    got = losses(run)
    worst = max(abs(a - b) for a, b in zip(got, want_losses, strict=True))
    assert worst <= 1e-5, (name, got, want_losses)
    diff, param = max_param_diff(final_state(run), want_params)
    assert diff <= 1e-5, f"{name}: parameter {param} differs from the replay by {diff:.2e}"
    assert_ranks_agree(run)


def check_loss(run, method: str, baseline: float) -> None:
    """(c): the final loss within LOSS_TOL[method] of uncompressed data parallelism's."""
    got = losses(run)[-1]
    assert abs(got - baseline) <= LOSS_TOL[method], (run.config["options"], got, baseline)


# --- default: 2 ranks ----------------------------------------------------------------------

def test_bytes_per_step_are_the_formulas(runs2):
    for name, run in runs2.items():
        strategy, _, method = CASES[name]
        check_bytes(run, method, dlab_counts_wire=strategy == "ddp")
    # less than plain all-reduce: half; ~(n + m) r / (n m) (0.11 here); ratio * N (0.1)
    plain = est.bytes_per_step("none", SHAPES, CAP, 2)
    sent = {name: runs2[name].metrics(0)[-1]["comm"]["sent_bytes"] for name in ("fp16", "powersgd", "topk")}
    assert sent["fp16"] == plain / 2 and sent["powersgd"] < plain / 8 and sent["topk"] < plain / 8


def test_powersgd_and_topk_train_as_their_rules(runs2):
    for name in ("powersgd", "topk"):
        check_rule(runs2[name], name)


def test_loss_stays_near_uncompressed(runs2):
    baseline = replay(2, uncompressed)[0][-1]
    for name, run in runs2.items():
        check_loss(run, CASES[name][2], baseline)


def test_compressed_buckets_overlap_backward(runs2):
    """Each compressed bucket is reduced from its gradient hook, in bucket order, the first
    while backward is still running (the same communication thread as the ring)."""
    for name, op in (("powersgd", "all_reduce"), ("topk", "all_gather")):
        for step in range(CONFIG["steps"]):
            ev = [e for e in runs2[name].timeline(0) if e["step"] == step]
            backward = next(e for e in ev if e["kind"] == "backward")
            reduces = sorted((e for e in ev if e["kind"] == op), key=lambda e: e["start"])
            assert [e["bucket"] for e in reduces] == list(range(len(est.buckets(SHAPES, CAP))))
            assert reduces[0]["start"] < backward["end"], (name, step)


def test_state_is_counted_as_comm_buffers(runs2):
    """Top-k's memory is a gradient's size; PowerSGD's errors are its matrices' and P, Q."""
    params = 4 * sum(math.prod(s) for s in SHAPES)
    assert runs2["topk"].metrics(0)[-1]["memory"]["comm_buffers"] == params
    assert 0 < runs2["powersgd"].metrics(0)[-1]["memory"]["comm_buffers"] < 1.2 * params
    assert runs2["fp16"].metrics(0)[-1]["memory"]["comm_buffers"] == 0


# --- slow: the fp16 peer at 2 ranks; 4 ranks, with the bf16 peer and ddp itself -----------

@pytest.mark.slow
def test_fp16_takes_pytorchs_hook_steps_exactly_at_two_ranks(runs2, tmp_path):
    peer = launch_all(["peer-fp16"], 2, tmp_path / "runs")["peer-fp16"]
    check_bytes(peer, "fp16", dlab_counts_wire=False)
    diff, name = max_param_diff(final_state(runs2["fp16"]), final_state(peer))
    assert diff <= 1e-6, f"{name} differs from PyTorch's fp16_compress_hook by {diff:.2e}"


@pytest.mark.slow
def test_every_check_at_four_ranks(tmp_path):
    runs = launch_all(list(CASES), 4, tmp_path / "runs")
    baseline = losses(runs["none"])[-1]
    assert abs(baseline - replay(4, uncompressed)[0][-1]) <= 1e-5
    for name, run in runs.items():
        strategy, _, method = CASES[name]
        check_bytes(run, method, dlab_counts_wire=strategy == "ddp")
        if method != "none":
            check_loss(run, method, baseline)
    for name in ("powersgd", "topk"):
        check_rule(runs[name], name)


# --- no processes: formulas and refusals -------------------------------------------------

def test_formulas_by_hand():
    """Two tensors in one bucket, N = 4: a 64 x 32 matrix and a 32-vector (8 KiB + 128 B)."""
    shapes, n, cap = [(64, 32), (32,)], 4, 1 << 20
    plain = 2 * 3 / 4 * 4 * (64 * 32 + 32)
    assert est.bytes_per_step("none", shapes, cap, n) == plain
    assert est.bytes_per_step("fp16", shapes, cap, n) == plain / 2
    # rank 2: P 64 x 2, Q 32 x 2 and the vector, in three all-reduces
    assert est.messages("powersgd", shapes, cap, n, rank=2, step=5) == [
        ("all_reduce", 4 * 32, 4), ("all_reduce", 4 * 128, 4), ("all_reduce", 4 * 64, 4)]
    assert est.bytes_per_step("powersgd", shapes, cap, n, rank=2, step=5) == 2 * 3 / 4 * 4 * (32 + 192)
    assert est.bytes_per_step("powersgd", shapes, cap, n, rank=2, step=1) == plain  # before start
    # rank 11 would send (64 + 32) 11 * 2 > 64 * 32: the matrix goes whole
    assert est.bytes_per_step("powersgd", shapes, cap, n, rank=11, step=5) == plain
    # k = 21 of 2080 entries: 21 values + 21 indices from each of 4 ranks, 3/4 of it sent
    assert est.bytes_per_step("topk", shapes, cap, n, ratio=0.01) == 3 / 4 * 4 * 21 * 8


@pytest.mark.parametrize("strategy, options, config, message", [
    ("ddp", {"compress": "zip"}, {}, "compress='zip' is not one of"),
    ("ddp", {"compress": "topk", "topk_ratio": 1.5}, {}, "so at most 1"),
    ("ddp", {"compress": "topk", "topk_ratio": 0}, {}, "option topk_ratio must be a positive"),
    ("ddp", {"compress": "powersgd", "powersgd_rank": 0}, {}, "option powersgd_rank must be a whole number"),
    ("ddp", {"compress": "topk", "powersgd_rank": 2}, {}, "set compress='powersgd' or drop powersgd_rank"),
    ("ddp", {"topk_ratio": 0.1}, {}, "set compress='topk' or drop topk_ratio"),
    ("ddp", {"compress": "fp16", "allreduce": "ring"}, {}, "use allreduce='backend'"),
    ("ddp", {"compress": "powersgd"}, {"checkpoint_every": 2}, "set checkpoint_every=0"),
    ("torch-ddp", {"comm_hook": "powersgd", "powersgd_start": 1}, {},
     "option powersgd_start must be a whole number >= 2"),
    ("torch-ddp", {"comm_hook": "fp16", "powersgd_rank": 2}, {}, "set comm_hook='powersgd' or drop"),
])
def test_bad_options_are_refused_before_start(strategy, options, config, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(RunConfig(strategy, world_size=2, options=options, **config))
    start = time.monotonic()
    with pytest.raises(ConfigError):
        dlab.launch(strategy, 2, runs_dir=tmp_path / "runs", options=options, **config, **TINY_GPT)
    assert time.monotonic() - start < 2 and not (tmp_path / "runs").exists()
