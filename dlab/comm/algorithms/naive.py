"""Naive all-reduce: reduce everything to rank 0, one rank at a time, then send the result back
one rank at a time.

The baseline every other algorithm is measured against. The root receives N-1 full vectors
and sends N-1 full vectors, strictly in turn, so both its link and the schedule are serial:

    root sends (N-1) S and receives (N-1) S;  every other rank sends S and receives S
    T = 2 (N-1) (alpha + S beta)

Any N works (nothing is split). The root is a hot spot: its traffic grows with N while the
others idle, which is what the parameter server spreads out over time and the ring over links.
"""
from __future__ import annotations

from dlab.comm.algorithms.exchange import Exchange, Recv, Send


def naive_all_reduce(tensor, group=None, op="sum", trace=False, root: int = 0):
    ex = Exchange("naive", tensor, group, op, trace, chunks=1)
    n, me = ex.size, ex.rank
    others = [r for r in range(n) if r != root]
    everything = (0,)
    for s, r in enumerate(others):  # gather-and-fold, one sender per step
        if me == root:
            ex.step(s, recvs=[Recv(r, ex.flat, everything, reduce=True)])
        elif me == r:
            ex.step(s, sends=[Send(root, ex.flat, everything, reduce=True)])
    for s, r in enumerate(others, start=len(others)):  # then hand the result back, in turn
        if me == root:
            ex.step(s, sends=[Send(r, ex.flat, everything)])
        elif me == r:
            ex.step(s, recvs=[Recv(root, ex.flat, everything)])
    return ex.finish(rounds=2 * len(others))
