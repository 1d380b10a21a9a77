"""All-reduce algorithms written from point-to-point messages only, and the other collectives.

Every all-reduce here has the signature ``NAME_all_reduce(tensor, group=None, op="sum",
trace=False, **options) -> Report``: it reduces ``tensor`` in place over ``group`` (None: the
world) with ``op`` in {"sum", "max", "avg"} using only isend / irecv (batch_isend_irecv), and
returns what this rank did (``report.Report``). ``ALGORITHMS`` maps their names to them:

    naive               reduce to rank 0 one rank at a time, then send back      naive.py
    ps                  parameter server: all push to one server at once, pull   parameter_server.py
    ring                reduce-scatter + all-gather round a ring                 ring.py
    tree                pipelined binary tree, up then down                      tree.py
    recursive-doubling  log2 N full-vector exchanges                             recursive.py
    rabenseifner        recursive halving reduce-scatter + doubling all-gather   recursive.py
    hierarchical        intra-node / inter-node / intra-node (node_size=2)       hierarchical.py
    shm                 one host: reduce-scatter + all-gather in shared memory  shm.py

``collectives`` has reduce-scatter, all-gather, broadcast and all-to-all built the same way,
and ``dlab.theory.comm`` the alpha-beta cost of each.
"""
from __future__ import annotations

from dlab.comm.algorithms.hierarchical import hierarchical_all_reduce
from dlab.comm.algorithms.naive import naive_all_reduce
from dlab.comm.algorithms.parameter_server import ps_all_reduce
from dlab.comm.algorithms.recursive import rabenseifner_all_reduce, recursive_doubling_all_reduce
from dlab.comm.algorithms.report import Report, Transfer, holdings, merged_trace
from dlab.comm.algorithms.ring import ring_all_reduce
from dlab.comm.algorithms.shm import shm_all_reduce
from dlab.comm.algorithms.tree import tree_all_reduce

ALGORITHMS = {
    "naive": naive_all_reduce,
    "ps": ps_all_reduce,
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "recursive-doubling": recursive_doubling_all_reduce,
    "rabenseifner": rabenseifner_all_reduce,
    "hierarchical": hierarchical_all_reduce,
    "shm": shm_all_reduce,
}

__all__ = ["ALGORITHMS", "Report", "Transfer", "holdings", "merged_trace"] + [
    f.__name__ for f in ALGORITHMS.values()]
