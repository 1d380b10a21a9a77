"""Every hand-written all-reduce equals dist.all_reduce, on 2, 3 and 4 ranks, and sends the bytes
its formula says.

All cases for one world size run inside ONE spawn (``all_cases``), which returns plain data;
the tests then only look at it, so the whole file costs three process starts.
"""
from __future__ import annotations

import pytest

import dlab
from dlab.theory.comm import allreduce_rounds, allreduce_sent_bytes

SIZES = [1, 7, 1001, 2 ** 15 + 3]  # none divides evenly over 2, 3 or 4 ranks (1 is smaller than N)
EVEN = 2 ** 12 * 3  # splits evenly into 2, 3, 4 ring chunks and 2 or 4 halving blocks
OPS = {"float32": ["sum", "max", "avg"], "int64": ["sum", "max"]}


def _data(rank: int, numel: int, dtype):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (numel,), generator=g)
    return torch.randn(numel, generator=g)


def all_cases() -> dict:
    """On every rank: run every algorithm on every case; return what the tests check."""
    import torch
    import torch.distributed as dist

    from dlab.comm.algorithms import ALGORITHMS

    rank, n = dist.get_rank(), dist.get_world_size()
    out = {"parity": {}, "identical": {}, "reports": {}, "traces": {}, "errors": {}}
    for name, fn in ALGORITHMS.items():
        for dtype_name, ops in OPS.items():
            dtype = getattr(torch, dtype_name)
            for numel in SIZES + [EVEN]:
                for op in ops:
                    mine = _data(rank, numel, dtype)
                    ref = mine.clone()
                    report = fn(mine, op=op)
                    dist.all_reduce(ref, op=getattr(dist.ReduceOp, op.upper()))
                    if dtype.is_floating_point:
                        ok = torch.allclose(mine, ref, rtol=1e-5, atol=1e-5)
                    else:
                        ok = torch.equal(mine, ref)
                    everyone = [torch.empty_like(mine) for _ in range(n)]
                    dist.all_gather(everyone, mine)
                    key = (name, dtype_name, numel, op)
                    out["parity"][key] = ok
                    out["identical"][key] = all(torch.equal(e, everyone[0]) for e in everyone)
                    if op == "sum":
                        out["reports"][(name, dtype_name, numel)] = report.to_dict()
        # a strided view (every other element of a 2-D tensor) is reduced in place too
        base = _data(rank, 2 * 3 * 37, torch.float32).view(6, 37)
        view, ref = base[:, ::2], base[:, ::2].clone()
        fn(view, op="sum")
        dist.all_reduce(ref)
        out["parity"][(name, "strided", view.numel(), "sum")] = torch.allclose(view, ref, atol=1e-5)
        out["traces"][name] = fn(_data(rank, 24, torch.float32), trace=True)
        try:
            fn(torch.ones(3, dtype=torch.int64), op="avg")
        except ValueError as e:
            out["errors"][name] = str(e)
    # many pieces: the tree's pipeline, and messages cut into pieces folded as they land
    out["pieces"] = {}
    for name in ("ring", "tree", "hierarchical"):
        for dtype_name in OPS:
            mine = _data(rank, 1001, getattr(torch, dtype_name))
            ref = mine.clone()
            report = ALGORITHMS[name](mine, piece_bytes=256)
            dist.all_reduce(ref)
            out["parity"][(name, dtype_name, 1001, "pieces")] = (
                torch.allclose(mine, ref, atol=1e-5) if mine.is_floating_point() else torch.equal(mine, ref))
            out["pieces"][(name, dtype_name)] = report.to_dict()
    try:
        ALGORITHMS["hierarchical"](torch.ones(4), node_size=n + 1)
    except ValueError as e:
        out["node_size"] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def world(request, tmp_path_factory):
    runs = tmp_path_factory.mktemp(f"allreduce{request.param}")
    return request.param, dlab.spawn(all_cases, request.param, runs_dir=runs, timeout_s=120)


def test_every_algorithm_equals_dist_all_reduce(world):
    n, results = world
    for rank, res in enumerate(results):
        wrong = [k for k, ok in res["parity"].items() if not ok]
        assert not wrong, f"{n} ranks, rank {rank}: differs from dist.all_reduce for {wrong}"
        assert len(res["parity"]) == 8 * (len(SIZES) + 1) * 5 + 8 + 6  # 8 algorithms, 6 piece cases


def test_every_rank_ends_with_the_same_bits(world):
    """Data-parallel replicas stay identical only if every rank gets bit-identical sums."""
    n, results = world
    not_same = [k for k, same in results[0]["identical"].items() if not same]
    assert not not_same, f"{n} ranks: ranks disagree for {not_same}"


def test_bytes_sent_and_rounds_match_the_formulas(world):
    n, results = world
    nbytes = EVEN * 4
    for rank, res in enumerate(results):
        for name in res["traces"]:
            rep = res["reports"][(name, "float32", EVEN)]
            want = allreduce_sent_bytes(name, nbytes, n, rank)
            assert rep["sent_bytes"] == want, (name, n, rank, rep["sent_bytes"], want)
            assert rep["recv_bytes"] == want, (name, n, rank)
            assert rep["rounds"] == allreduce_rounds(name, n, nbytes), (name, n)
            assert rep["steps"] <= rep["rounds"]
    # the ring's 2 (N-1)/N S, explicitly, and its exact figure when chunks are uneven
    assert results[0]["reports"][("ring", "float32", EVEN)]["sent_bytes"] == 2 * (n - 1) / n * nbytes
    for numel in SIZES:
        chunk = [(i + 1) * numel // n - i * numel // n for i in range(n)]
        for rank, res in enumerate(results):
            sent = res["reports"][("ring", "int64", numel)]["sent_bytes"]
            assert sent == 8 * (2 * numel - chunk[rank] - chunk[(rank + 1) % n]), (numel, rank)


def test_pipelined_tree_takes_the_rounds_of_its_schedule(world):
    n, results = world
    for rank, res in enumerate(results):
        for dtype, item in (("float32", 4), ("int64", 8)):
            rep = res["pieces"][("tree", dtype)]
            assert rep["chunks"] == -(-1001 * item // 256)  # one trace chunk per piece
            assert rep["rounds"] == allreduce_rounds("tree", n, 1001 * item, piece_bytes=256)
            assert rep["sent_bytes"] == allreduce_sent_bytes("tree", 1001 * item, n, rank)


def test_trace_replays_to_everyone_holding_everything(world):
    from dlab.comm.algorithms import holdings
    n, results = world
    for name in results[0]["traces"]:
        reports = [res["traces"][name] for res in results]
        h = holdings(reports)
        assert all(c == {r} for r in range(n) for c in h[0][r])
        assert all(c == frozenset(range(n)) for row in h[-1] for c in row), (name, h[-1])
        assert len(h) == reports[0].rounds + 1
        # every message in the trace was sent by the rank that reports it
        assert all(t.src == rep.rank for rep in reports for t in rep.trace)


def test_avg_of_integers_is_refused_with_a_reason(world):
    _, results = world
    assert set(results[0]["errors"]) == set(results[0]["traces"])
    assert all("floating-point" in e for e in results[0]["errors"].values())
    assert "must divide the world size" in results[0]["node_size"]


def test_ring_trace_is_the_textbook_schedule(world):
    """Reduce-scatter step s: rank i sends chunk (i-s-1) mod N to rank i+1, holding s+1 ranks."""
    n, results = world
    for t in results[0]["traces"]["ring"].trace:
        if t.step < n - 1:
            assert t.chunk == (0 - t.step - 1) % n and t.dst == 1 % n and t.reduce
            assert t.holds == tuple(sorted((0 - j) % n for j in range(t.step + 1)))


def test_cost_model_is_consistent_and_fits_exact_data():
    from dlab.theory.comm import AlphaBeta, allreduce_time, fit_alpha_beta, ring_allreduce_time
    link = AlphaBeta(alpha=50e-6, beta=1e-9)
    sizes = [4, 4096, 1 << 20, 64 << 20]
    for relative in (False, True):
        fit = fit_alpha_beta(sizes, [link.time(s) for s in sizes], relative=relative)
        assert fit.alpha == pytest.approx(link.alpha, rel=1e-6) and fit.beta == pytest.approx(link.beta)
    for n in (2, 3, 4, 8):
        want = ring_allreduce_time(1 << 20, n, link)
        assert allreduce_time("ring", 1 << 20, n, link) == pytest.approx(want)
    # recursive doubling wins below S* = (2(N-1) - log2 N) alpha / ((log2 N - 2(N-1)/N) beta)
    cross = 8 * link.alpha / link.beta  # N = 4
    for size, rd_wins in ((cross / 2, True), (cross * 2, False)):
        rd, ring = (allreduce_time(a, size, 4, link) for a in ("recursive-doubling", "ring"))
        assert (rd < ring) == rd_wins
    assert allreduce_rounds("rabenseifner", 3) == 4 and allreduce_rounds("recursive-doubling", 5) == 4
