"""Context-parallel attention: ring, all-gather, Ulysses and USP (Ulysses in pairs of ranks,
the ring across the pairs) against one process's causal attention (outputs and the gradients
of q, k and v) for both layouts at 2 and 4 ranks, the K/V bytes they send against
``dlab.theory.context`` (and, where the wire is measurable, Ulysses' all-to-alls on the wire
against Gloo's), and the layouts' causal work."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dlab
from dlab.layout import tokens as layout
from dlab.theory import context as est

B, H, T, D = 2, 4, 16, 4  # T divides into 2n chunks and H into n heads for n = 2 and 4


def _attention_checks() -> dict:
    """On each rank: every (attention, layout) on this rank's tokens vs full causal SDPA."""
    import torch.distributed as dist

    from dlab.comm.instrumented import Comm
    from dlab.parallel.context.attention import (
        Hybrid,
        Ring,
        allgather_attention,
        ring_attention,
        ulysses_attention,
        usp_attention,
    )

    comm = Comm()
    u = 2  # USP's Ulysses groups: consecutive pairs; its rings: the ranks at one place in each
    pairs = [dist.new_group(list(range(g, g + u))) for g in range(0, comm.size, u)]
    rings = [dist.new_group(list(range(j, comm.size, u))) for j in range(u)]
    heads, across = Comm(pairs[comm.rank // u]), Comm(rings[comm.rank % u])
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    up = torch.randn(B, H, T, D)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (y * up).sum().backward()
    out = {}
    for lay in layout.LAYOUTS:
        positions = [layout.positions(lay, T, r, comm.size) for r in range(comm.size)]
        mine = positions[comm.rank]
        for name, fn in (("ring", ring_attention), ("allgather", allgather_attention),
                         ("ulysses", ulysses_attention), ("usp", usp_attention)):
            ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
            talking = [heads, across] if name == "usp" else [comm]
            before = sum(c.totals().sent_bytes for c in talking)
            a2a = comm.stats["all_to_all"]
            wire0, gloo0 = a2a.wire_bytes, a2a.gloo_bytes
            how = Hybrid(heads, across, positions) if name == "usp" else Ring(comm, positions)
            yl = fn(ql, kl, vl, how)
            (yl * up[:, :, mine]).sum().backward()
            errors = {"y": yl - y[:, :, mine], "dq": ql.grad - q.grad[:, :, mine],
                      "dk": kl.grad - k.grad[:, :, mine], "dv": vl.grad - v.grad[:, :, mine]}
            out[(lay, name)] = {**{e: d.abs().max().item() for e, d in errors.items()},
                                "sent": sum(c.totals().sent_bytes for c in talking) - before}
            if name == "ulysses" and a2a.wire_bytes is not None:
                out[(lay, name)].update(wire=a2a.wire_bytes - (wire0 or 0),
                                        gloo=a2a.gloo_bytes - (gloo0 or 0))
    dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_allgather_ulysses_and_usp_attention_equal_full_causal_attention(world_size, runs_dir):
    results = dlab.spawn(_attention_checks, world_size, runs_dir=runs_dir)
    kv = est.kv_bytes(B * H, T, D, world_size)  # K and V of one rank: (B H) rows of T/n x D
    for rank, checks in enumerate(results):
        for (lay, name), got in checks.items():
            for what in ("y", "dq", "dk", "dv"):
                assert got[what] < 1e-5, (rank, lay, name, what, got[what])
            want = est.sent_per_step(name, world_size, n_layer=1, kv=kv, param_bytes=0, ulysses=2)
            assert got["sent"] == want, (rank, lay, name, got["sent"], want)
            if "wire" in got:  # four all-to-alls forward and back, as Gloo sends them
                assert got["wire"] == got["gloo"] > want, (rank, lay, got)


def test_zigzag_balances_the_causal_work_and_contiguous_does_not():
    n, t = 4, 64
    zig = [layout.visible_pairs("zigzag", t, r, n) for r in range(n)]
    cont = [layout.visible_pairs("contiguous", t, r, n) for r in range(n)]
    assert sum(zig) == sum(cont) == t * (t + 1) // 2  # the causal triangle, counted once
    assert len(set(zig)) == 1
    c = t // n  # contiguous: rank r sees r full blocks and half of the diagonal one
    assert cont == [r * c * c + c * (c + 1) // 2 for r in range(n)]
