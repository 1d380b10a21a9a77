"""Reduce-scatter, all-gather, broadcast and all-to-all from point-to-point equal their torch
counterparts on 2, 3 and 4 ranks, uneven sizes included, and send the bytes their formulas say.
One spawn per world size runs every case (``all_cases``)."""
from __future__ import annotations

import pytest

import dlab


def _data(rank: int, numel: int, dtype_name: str = "float32"):
    import torch
    g = torch.Generator().manual_seed(7 * rank + numel)
    if dtype_name == "int64":
        return torch.randint(-100, 100, (numel,), generator=g)
    return torch.randn(numel, generator=g)


def _same(a, b) -> bool:
    import torch
    return torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, atol=1e-5)


def all_cases() -> dict:
    import torch
    import torch.distributed as dist

    from dlab.comm.algorithms.collectives import all_gather, all_to_all, broadcast, reduce_scatter
    from dlab.comm.algorithms.exchange import chunk_bounds

    rank, n = dist.get_rank(), dist.get_world_size()
    ok, sent = {}, {}
    for dtype in ("float32", "int64"):
        for numel in (1, 10, 1001, 12 * 64):
            x = _data(rank, numel, dtype)
            b = chunk_bounds(numel, n)
            for op in ("sum", "max") + (("avg",) if dtype == "float32" else ()):
                out = torch.empty(b[rank + 1] - b[rank], dtype=x.dtype)
                rep = reduce_scatter(out, x, op=op)
                full = x.clone()
                dist.all_reduce(full, op=getattr(dist.ReduceOp, op.upper()))
                ok[("reduce_scatter", dtype, numel, op)] = _same(out, full[b[rank]:b[rank + 1]]) and \
                    torch.equal(x, _data(rank, numel, dtype))
                sent[("reduce_scatter", dtype, numel, op)] = rep.sent_bytes
            # all-gather with a different count on every rank (Gloo's own cannot)
            splits = [numel + r for r in range(n)]
            mine = _data(rank, splits[rank], dtype)
            out = torch.empty(sum(splits), dtype=mine.dtype)
            rep = all_gather(out, mine, splits=splits)
            ok[("all_gather", dtype, numel)] = torch.equal(
                out, torch.cat([_data(r, splits[r], dtype) for r in range(n)]))
            sent[("all_gather", dtype, numel)] = rep.sent_bytes
            for src in range(n):
                t = _data(rank, numel, dtype)
                rep = broadcast(t, src=src)
                ok[("broadcast", dtype, numel, src)] = torch.equal(t, _data(src, numel, dtype))
                sent[("broadcast", dtype, numel, src)] = rep.sent_bytes
    # even tensors against reduce_scatter_tensor, and 2-D all-to-all with uneven splits
    x = _data(rank, 12 * n)
    out, ref = torch.empty(12), torch.empty(12)
    reduce_scatter(out, x)
    dist.reduce_scatter_tensor(ref, x)
    ok[("reduce_scatter_tensor",)] = torch.allclose(out, ref, atol=1e-5)
    for case, in_splits in {"uneven": [(rank + j) % 3 for j in range(n)], "even": None}.items():
        rows = sum(in_splits) if in_splits else 2 * n
        inp = _data(rank, rows * 5).view(rows, 5)
        if in_splits:
            counts = torch.tensor(in_splits)
            everyone = [torch.empty_like(counts) for _ in range(n)]
            dist.all_gather(everyone, counts)
            out_splits = [int(e[rank]) for e in everyone]
        else:
            out_splits = None
        out_rows = sum(out_splits) if out_splits else rows
        out, ref = torch.empty(out_rows, 5), torch.empty(out_rows, 5)
        rep = all_to_all(out, inp, out_splits, in_splits)
        dist.all_to_all_single(ref, inp, out_splits, in_splits)
        ok[("all_to_all", case)] = torch.equal(out, ref)
        own = in_splits[rank] if in_splits else 2
        sent[("all_to_all", case)] = (rep.sent_bytes, (rows - own) * 5 * 4)
    traces = {"all_gather": all_gather(torch.empty(4 * n), torch.ones(4), trace=True),
              "broadcast": broadcast(torch.ones(4), src=n - 1, trace=True)}
    errors = {}
    try:
        all_to_all(torch.empty(n + 1, 2), torch.empty(n + 1, 2))
    except ValueError as e:
        errors["all_to_all"] = str(e)
    try:
        reduce_scatter(torch.empty(3), torch.ones(10), splits=[1] * n)
    except ValueError as e:
        errors["reduce_scatter"] = str(e)
    return {"ok": ok, "sent": sent, "traces": traces, "errors": errors}


@pytest.fixture(scope="module", params=[2, 3, 4])
def world(request, tmp_path_factory):
    runs = tmp_path_factory.mktemp(f"collectives{request.param}")
    return request.param, dlab.spawn(all_cases, request.param, runs_dir=runs, timeout_s=120)


def test_collectives_equal_torch(world):
    n, results = world
    for rank, res in enumerate(results):
        wrong = [k for k, good in res["ok"].items() if not good]
        assert not wrong, f"{n} ranks, rank {rank}: wrong for {wrong}"


def test_bytes_sent_match_the_formulas(world):
    n, results = world
    for rank, res in enumerate(results):
        for (name, dtype, numel, *_), sent in ((k, v) for k, v in res["sent"].items() if len(k) > 2):
            item = 4 if dtype == "float32" else 8
            chunk = [(i + 1) * numel // n - i * numel // n for i in range(n)]
            if name == "reduce_scatter":  # every chunk but its own: (N-1)/N S when even
                assert sent == item * (numel - chunk[rank]), (n, rank, numel)
            if name == "all_gather":  # every chunk but the next rank's
                assert sent == item * (sum(numel + r for r in range(n)) - (numel + (rank + 1) % n))
            if name == "broadcast":  # S to each binomial child
                src = _[0]
                v = (rank - src) % n
                children = sum(v < (1 << k) and v + (1 << k) < n for k in range(n.bit_length()))
                assert sent == item * numel * children, (n, rank, src)
        for case in ("even", "uneven"):
            got, want = res["sent"][("all_to_all", case)]
            assert got == want
    even = results[0]["sent"][("reduce_scatter", "float32", 12 * 64, "sum")]
    assert even == (n - 1) / n * 12 * 64 * 4


def test_traces_show_the_gather_and_the_broadcast(world):
    from dlab.comm.algorithms import holdings
    n, results = world
    final = holdings([r["traces"]["all_gather"] for r in results])[-1]
    assert all(final[r][c] == {c} for r in range(n) for c in range(n))  # rank r holds c's chunk
    h = holdings([r["traces"]["broadcast"] for r in results])
    assert all(h[-1][r][0] == {n - 1} for r in range(n))
    assert len(h) - 1 == (n - 1).bit_length()  # ceil(log2 N) rounds


def test_bad_splits_are_refused_with_what_to_change(world):
    _, results = world
    assert "pass input_splits" in results[0]["errors"]["all_to_all"]
    assert "summing to 10" in results[0]["errors"]["reduce_scatter"]
