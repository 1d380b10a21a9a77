"""What data parallelism moves and how long it takes: the formulas the tests and notebook
check the measured figures against.

Notation: P bytes of gradients (= of parameters, fp32 here), N data-parallel ranks, T gradient
tensors, B buckets. Bytes are per rank and per optimizer step, counted as ``dlab.comm`` counts
them (the bandwidth-optimal ring for the backend's all-reduce).

    dp-naive, ddp, torch-ddp   sent = received = 2 (N-1)/N * P      (T or B messages)
    ps-sync, ps-async          worker: sent = received = P          (push grads, pull weights)
                               server: sent = received = (N-1) P    (rank 0, also a worker)

All-reduce moves less than twice the weights per rank and spreads it over every link; the
parameter server moves exactly twice the weights per worker but funnels N-1 times that through
one server. Gradient accumulation with ``no_sync`` does not change the bytes per optimizer
step: the inner micro-batches do not communicate.
"""
from __future__ import annotations

from dlab.theory.comm import AlphaBeta, ring_allreduce_time

ALL_REDUCE = ("dp-naive", "ddp", "torch-ddp")
PARAMETER_SERVER = ("ps-sync", "ps-async")
SERVER = 0


def allreduce_bytes(param_bytes: float, world_size: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``param_bytes``."""
    n = world_size
    return 2 * (n - 1) / n * param_bytes


def ps_bytes(param_bytes: float, world_size: int, rank: int) -> float:
    """Bytes a rank sends (and receives) in one parameter-server round."""
    return (world_size - 1) * param_bytes if rank == SERVER else (param_bytes if world_size > 1 else 0.0)


def bytes_per_step(strategy: str, param_bytes: float, world_size: int, rank: int = 1
                   ) -> dict[str, float]:
    """``{"sent": ..., "recv": ...}`` for one rank and one optimizer step of ``strategy``."""
    if strategy in ALL_REDUCE:
        b = allreduce_bytes(param_bytes, world_size)
    elif strategy in PARAMETER_SERVER:
        b = ps_bytes(param_bytes, world_size, rank)
    else:
        raise ValueError(f"no data-parallel bytes formula for {strategy!r}; known: "
                         f"{', '.join(ALL_REDUCE + PARAMETER_SERVER)}")
    return {"sent": b, "recv": b}


def bucket_sizes(param_bytes: list[int], cap_bytes: int) -> list[int]:
    """Bytes of each ``ddp`` bucket for tensors of ``param_bytes`` (registration order): the B
    messages of a step. The rule (PyTorch's, Li et al. 2020 sec. 3.2.3): walk the tensors in
    the order backward produces them, the reverse of registration, and close the open bucket
    when the next tensor would take it past the cap; a tensor larger than the cap is a bucket
    on its own. Written here from that rule, apart from the strategy's ``buckets.assign``, so
    the tests compare two derivations."""
    if cap_bytes <= 0:
        raise ValueError(f"the bucket cap must be positive (got {cap_bytes} bytes)")
    sizes: list[int] = []
    for size in reversed(param_bytes):
        if sizes and sizes[-1] + size <= cap_bytes:
            sizes[-1] += size
        else:
            sizes.append(size)
    return sizes


def comm_time(message_bytes: list[float], world_size: int, link: AlphaBeta) -> float:
    """Alpha-beta time of ring all-reduces of these messages, one after another:
    sum of 2(N-1) alpha + 2(N-1)/N S beta. Same bytes, but ``dp-naive`` pays T start-ups where
    ``ddp`` pays B."""
    return sum(ring_allreduce_time(s, world_size, link) for s in message_bytes)


def ps_server_time(param_bytes: float, world_size: int, link: AlphaBeta) -> float:
    """The server's communication per round, its N-1 pushes and pulls sharing one link."""
    return link.time(2 * (world_size - 1) * param_bytes, messages=2 * (world_size - 1))


def exposed_comm_time(bucket_bytes: list[float], backward_s: float, world_size: int,
                      link: AlphaBeta) -> float:
    """Communication left after backward ends, for buckets all-reduced one at a time as they
    become ready. The model: backward produces gradient bytes at a constant rate, so bucket i
    is ready when the bytes of buckets 0..i are computed; its all-reduce starts when it is
    ready and the previous one has finished. What sticks out past backward is not hidden.
    Small buckets pay many start-ups; large ones start late and leave the last one exposed:
    the best cap lies between (the notebook's exercise)."""
    total = sum(bucket_bytes) or 1.0
    done = ready = 0.0
    for size in bucket_bytes:
        ready += backward_s * size / total
        done = max(done, ready) + ring_allreduce_time(size, world_size, link)
    return max(0.0, done - backward_s)
