"""Expert-parallel dispatch against the same MoE layer in one process, at 2 and 4 ranks: the
output and every gradient (input, router, each expert wherever it lives), and the bytes the
all-to-alls moved against ``dlab.theory.expert``."""
from __future__ import annotations

import pytest
import torch

import dlab
from dlab.theory import expert as est

D, E, TOKENS = 8, 8, 12  # E divides by 4; TOKENS per rank


def _layer_checks(k: int) -> dict:
    """On each rank: its own tokens through an expert-parallel MoE layer vs every rank's tokens
    through the whole layer in one process."""
    import torch.distributed as dist

    from dlab.comm.instrumented import Comm
    from dlab.models.moe import MoE, MoEConfig
    from dlab.parallel.expert.dispatch import ExpertParallelCombine

    comm, n, r = Comm(), dist.get_world_size(), dist.get_rank()
    cfg = MoEConfig(d_model=D, n_head=1, n_expert=E, top_k=k)
    torch.manual_seed(0)
    whole = MoE(cfg)
    x = torch.randn(n * TOKENS, D, requires_grad=True)
    up = torch.randn(n * TOKENS, D)
    (whole(x) * up).sum().backward()
    want = whole(x).detach()

    torch.manual_seed(0)
    mine = MoE(cfg)
    per = E // n
    local = {e: mine.experts[e] for e in range(r * per, (r + 1) * per)}
    mine.combine = ExpertParallelCombine(comm, local, E)
    rows = slice(r * TOKENS, (r + 1) * TOKENS)
    xl = x.detach()[rows].clone().requires_grad_()
    y = mine(xl)
    (y * up[rows]).sum().backward()
    router_grad = mine.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # the router saw this rank's tokens only

    def err(a, b):
        # a gradient that never arrived is as wrong as can be, not zero
        return (a - b).abs().max().item() if a is not None else float("inf")

    return {
        "y": err(y, want[rows]), "x.grad": err(xl.grad, x.grad[rows]),
        "router.grad": err(router_grad, whole.router.weight.grad),
        "experts.grad": max(err(p.grad, q.grad) for e in local for p, q in
                            zip(local[e].parameters(), whole.experts[e].parameters())),
        "sent": comm.totals().sent_bytes,
        "formula": est.all_to_all_bytes(n, D, mine.combine.rows_sent, mine.combine.rows_received),
        "rows_sent": mine.combine.rows_sent,
    }


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_layer_equals_the_whole_layer(world_size, k, runs_dir):
    results = dlab.spawn(_layer_checks, world_size, k, runs_dir=runs_dir)
    for rank, got in enumerate(results):
        for what in ("y", "x.grad", "router.grad", "experts.grad"):
            assert got[what] < 1e-5, (rank, what, got[what])
        assert got["sent"] == got["formula"], (rank, got)
    assert sum(g["rows_sent"] for g in results) > 0  # tokens did cross ranks
