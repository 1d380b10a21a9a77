"""Parameter-server all-reduce: every worker pushes its vector to one server at once, the server
folds them, and every worker pulls the result back (Li et al., OSDI 2014, in its simplest form:
one server, synchronous).

Same bytes as the naive algorithm but two steps instead of 2 (N-1): all N-1 pushes are posted
together, so they share the server's link instead of queueing for it. The server's link still
carries (N-1) S each way, which is the bottleneck that sharded servers (and then the ring)
remove:

    server sends (N-1) S and receives (N-1) S;  a worker sends S and receives S
    T = 2 alpha + 2 (N-1) S beta   (the server's link is the critical path)

Any N works. The server needs N-1 receive buffers of S bytes; it folds them in rank order.
"""
from __future__ import annotations

from dlab.comm.algorithms.exchange import Exchange, Recv, Send


def ps_all_reduce(tensor, group=None, op="sum", trace=False, server: int = 0):
    ex = Exchange("ps", tensor, group, op, trace, chunks=1)
    n, me = ex.size, ex.rank
    workers = [r for r in range(n) if r != server]
    everything = (0,)
    if me == server:
        ex.step(0, recvs=[Recv(w, ex.flat, everything, reduce=True) for w in workers])
        ex.step(1, sends=[Send(w, ex.flat, everything) for w in workers])
    else:
        ex.step(0, sends=[Send(server, ex.flat, everything, reduce=True)])
        ex.step(1, recvs=[Recv(server, ex.flat, everything)])
    return ex.finish(rounds=2 if n > 1 else 0)
