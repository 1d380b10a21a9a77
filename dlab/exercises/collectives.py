"""The collectives written from send/recv: a reduce-scatter (02) and the ring all-reduce (03),
whose judge also counts the bytes each rank sends (2(N-1)/N x S for a ring)."""
from __future__ import annotations

import torch

from dlab.exercises.registry import exercise
from dlab.exercises.watch import WORLD, per_rank, values


# --- 02: reduce-scatter from send/recv ----------------------------------------------------------
def _chunks(rank: int, world: int) -> list[torch.Tensor]:
    return [values(rank, 3, seed=10 + c) for c in range(world)]


def run_reduce_scatter(fn, rank, world):
    return fn(_chunks(rank, world), rank, world)


@exercise(name="reduce_scatter", notebook="02_collectives", ranks=WORLD, p2p_only=True,
          task="reduce_scatter(chunks, rank, world_size): chunks[c] is this rank's contribution to "
               "rank c; return the sum over all ranks of their chunk for this rank, with send/recv",
          run=run_reduce_scatter)
def judge_reduce_scatter(answers):
    want = [sum(_chunks(r, WORLD)[me] for r in range(WORLD)) for me in range(WORLD)]
    return per_rank(answers, want, "the reduced chunk")


# --- 03: ring all-reduce from send/recv ---------------------------------------------------------
RING_NUMEL = 10  # over 4 ranks: chunks of 3, 3, 2 and 2 elements, not all equal


def run_ring_all_reduce(fn, rank, world):
    x = values(rank, RING_NUMEL, seed=2)
    out = fn(x, rank, world)
    return x if out is None else out


def _count_sent(log):
    """Wrap send and isend (batch_isend_irecv calls them) to add up the bytes this rank sends."""
    log["sent"] = 0

    def counting(send):
        def counted(tensor, *args, **kwargs):
            log["sent"] += tensor.numel() * tensor.element_size()
            return send(tensor, *args, **kwargs)
        return counted
    return {"send": counting, "isend": counting}


@exercise(name="ring_all_reduce", notebook="03_allreduce_algorithms", ranks=WORLD, p2p_only=True,
          task="ring_all_reduce(x, rank, world_size): every rank ends with the sum of all ranks' x "
               "(a reduce-scatter then an all-gather around the ring), with send/recv, each rank "
               "sending 2(N-1)/N of x's bytes",
          run=run_ring_all_reduce, watch=_count_sent)
def judge_ring_all_reduce(answers):
    total = sum(values(r, RING_NUMEL, seed=2) for r in range(WORLD))
    wrong = per_rank([a for a, _ in answers], [total] * WORLD, "the sum")
    if wrong:
        return wrong
    # Patarasuk & Yuan 2009: each rank sends one chunk per step, 2(N-1) steps; with chunks of
    # unequal size a rank's bytes lie between 2(N-1) times the smallest and the largest chunk.
    size = 4  # float32
    chunks = [len(c) * size for c in torch.arange(RING_NUMEL).tensor_split(WORLD)]
    s, steps = RING_NUMEL * size, 2 * (WORLD - 1)
    lo, hi = steps * min(chunks), steps * max(chunks)
    for r, (_, log) in enumerate(answers):
        if not lo <= log["sent"] <= hi:
            why = ("more: does one rank gather and send back everything, or send whole tensors?"
                   if log["sent"] > hi else "less: is a half of the ring missing?")
            return (f"rank {r} sent {log['sent']} bytes; a ring all-reduce sends 2(N-1)/N x S = "
                    f"{steps * s / WORLD:g} bytes from every rank (S = {s} bytes, N = {WORLD}; "
                    f"{lo} to {hi} with chunks of unequal size), so the sum is right but this is "
                    f"not the ring, it sends {why}")
    return None
