"""Hierarchical all-reduce: inside each node, then across nodes, then inside each node again.

Ranks are grouped into nodes of ``node_size`` consecutive ranks (how torchrun numbers them).
With k = node_size ranks per node and m = N / k nodes:

1. intra-node ring reduce-scatter: local rank j ends up with chunk j of its node's sum;
2. inter-node ring all-reduce of chunk j among the m ranks with local rank j (one per node),
   so the m-fold slow links each carry only S/k bytes, k of them in parallel;
3. intra-node ring all-gather of the finished chunks.

    sent per rank = 2 (k-1)/k S  (fast links)  +  2 (m-1)/m S/k  (slow links)
    T = 2 (k-1) (alpha_in + S/k beta_in) + 2 (m-1) (alpha_out + S/(k m) beta_out)

This is the 2D scheme behind NCCL's multi-node rings and Horovod's hierarchical all-reduce:
the slow network sees 1/k of the traffic a flat ring would put on it. On one machine the
"nodes" are a rehearsal: ``node_size=2`` on 4 ranks runs exactly the messages two 2-GPU nodes
would. ``node_size`` must divide N (every node the same size, so local rank j exists on every
node); node_size=1 or N reduces to a flat ring. The default is 2 where N is even and above 2,
else N (one node).
"""
from __future__ import annotations

import torch.distributed as dist

from dlab.comm.algorithms.exchange import Exchange, chunk_bounds
from dlab.comm.algorithms.ring import Segment, all_gather_ring, reduce_scatter_ring


def hierarchical_all_reduce(tensor, group=None, op="sum", trace=False, node_size: int | None = None,
                            piece_bytes: int = 1 << 20):
    n = dist.get_world_size(group)
    if node_size is None:  # a 2-rank "node" rehearses two levels wherever N allows it
        node_size = 2 if n % 2 == 0 and n > 2 else n
    if node_size < 1 or n % node_size:
        raise ValueError(f"node_size={node_size} must divide the world size {n} (every node the "
                         f"same size): pick one of {[k for k in range(1, n + 1) if n % k == 0]}")
    k, m = node_size, n // node_size
    ex = Exchange("hierarchical", tensor, group, op, trace, chunks=n, piece_bytes=piece_bytes)
    node, local = divmod(ex.rank, k)
    numel = ex.flat.numel()
    outer = chunk_bounds(numel, k)  # chunk j of the vector belongs to local rank j
    chunks = [Segment(outer[j], outer[j + 1], tuple(range(j * m, (j + 1) * m))) for j in range(k)]
    lo, hi = outer[local], outer[local + 1]
    inner = [lo + b for b in chunk_bounds(hi - lo, m)]  # chunk `local`, cut again for the inter ring
    pieces = [Segment(inner[i], inner[i + 1], (local * m + i,)) for i in range(m)]
    same_node = [node * k + j for j in range(k)]
    same_local = [i * k + local for i in range(m)]
    step = reduce_scatter_ring(ex, same_node, chunks, 0)
    step = reduce_scatter_ring(ex, same_local, pieces, step)
    step = all_gather_ring(ex, same_local, pieces, step)
    step = all_gather_ring(ex, same_node, chunks, step)
    return ex.finish(rounds=step)
