"""Tree all-reduce: reduce up a binary tree to the root, broadcast back down, pipelined.

Ranks form a binary tree in heap order (rank r's children are 2r+1 and 2r+2, its parent
(r-1)//2), which is balanced for any N. The vector is cut into P pieces that stream through
the tree: a rank folds piece p from its children and passes it up while piece p+1 is still
coming, and the root starts sending piece p down as soon as it has it. In the ideal schedule
a piece climbs D = floor(log2 N) levels and descends D levels, so

    rounds = P + 2D - 1,   T = (P + 2D - 1) (alpha + 2 (S/P) beta)

(an inner rank takes two pieces in and sends two out per round, hence the 2). With one piece
it is latency-bound like recursive doubling; with many, bandwidth-bound like the ring but with
2 S per link instead of 2 (N-1)/N S. NCCL uses a double binary tree (two trees whose inner
nodes are each other's leaves, each carrying half the data) so that every rank's links carry
the same load (Sanders, Speck & Traeff 2009); one tree, as here, shows the pipeline.

Per rank: a leaf sends S and receives S; an inner rank with c children receives (c+1) S and
sends (c+1) S; the root receives and sends c S.
"""
from __future__ import annotations

import math

from dlab.comm.algorithms.exchange import Exchange, Recv, Send, chunk_bounds


def _depth(r: int) -> int:
    return (r + 1).bit_length() - 1


def tree_all_reduce(tensor, group=None, op="sum", trace=False, piece_bytes: int = 1 << 20):
    numel, size = tensor.numel(), tensor.numel() * tensor.element_size()
    pieces = max(1, min(math.ceil(size / piece_bytes), numel))
    ex = Exchange("tree", tensor, group, op, trace, chunks=pieces, piece_bytes=piece_bytes)
    n, me = ex.size, ex.rank
    bounds = chunk_bounds(numel, pieces)
    parent = (me - 1) // 2 if me else None
    children = [c for c in (2 * me + 1, 2 * me + 2) if c < n]
    top, d = _depth(n - 1), _depth(me)

    def piece(p: int):
        return ex.flat[bounds[p]:bounds[p + 1]]

    for p in range(pieces):  # up: fold the children's piece p, pass it on
        ex.step(p + top - d - 1, recvs=[Recv(c, piece(p), (p,), reduce=True) for c in children])
        if parent is not None:
            ex.step(p + top - d, sends=[Send(parent, piece(p), (p,), reduce=True)], wait_sends=False)
        else:
            ex.step(p + top, sends=[Send(c, piece(p), (p,)) for c in children], wait_sends=False)
    if parent is not None:
        ex.flush()  # our pieces went up before their finished versions can come down
        for p in range(pieces):  # down: take piece p from the parent, hand it to the children
            ex.step(p + top + d - 1, recvs=[Recv(parent, piece(p), (p,))])
            ex.step(p + top + d, sends=[Send(c, piece(p), (p,)) for c in children], wait_sends=False)
    return ex.finish(rounds=pieces + 2 * top - 1 if n > 1 else 0)
