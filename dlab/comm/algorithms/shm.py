"""Shared-memory all-reduce for ranks on one host: the data never touches a socket.

Gloo on one machine still talks TCP over loopback: every byte is copied into the kernel and out
again, and the ring adds 2 (N-1) such hops of S/N. Ranks on one host can instead map each
other's memory. Each rank owns a buffer in /dev/shm that every rank maps; then

1. every rank copies its tensor into its own buffer;               (barrier)
2. rank r folds chunk r of all N buffers into chunk r of its own;  (barrier)
3. every rank copies chunk j out of rank j's buffer, for every j.  (barrier before reuse)

It is the ring's reduce-scatter + all-gather with memory reads in place of messages: rank r's
buffer is read (N-1)/N S by others in step 2 and again in step 3, so the report's bytes are the
ring's 2 (N-1)/N S, but as memory traffic at memory bandwidth. The three barriers are
dissemination barriers of 1-byte point-to-point messages (ceil(log2 N) rounds each, Hensgen,
Finkel & Manber 1988), so the only messages are the synchronisation. On the wire
(``dlab.comm.wire``) a rank writes only those tokens and Gloo's framing, 3 ceil(log2 N) x 145
bytes a call (435 at N = 2, 870 at N = 4, measured); the report's ``message_bytes`` counts the
tokens. Any N; each chunk is reduced by one rank, so every rank ends with the same bits. NCCL
does the same inside a node through NVLink / PCIe peer memory (its "P2P" and "SHM" transports).

The buffers are created on first use per group and grown (to the next power of two) when a
larger tensor comes; each rank unlinks its file once all have mapped it, so nothing is left in
/dev/shm even if the process is killed.
"""
from __future__ import annotations

import math
import mmap
import os

import torch
import torch.distributed as dist

from dlab.comm.algorithms.exchange import chunk_bounds, op_name
from dlab.comm.algorithms.report import Report, Transfer

_buffers: dict[tuple, tuple[int, list[torch.Tensor], list]] = {}


def p2p_barrier(group=None) -> int:
    """Dissemination barrier: in round k, signal rank r + 2^k and wait for rank r - 2^k.
    Returns its rounds: the 1-byte messages this rank sent (and received)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)

    def peer(x):
        return dist.get_global_rank(group, x) if group is not None else x

    token, got = torch.zeros(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
    for k in range(math.ceil(math.log2(n)) if n > 1 else 0):
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, token, peer((r + (1 << k)) % n), group),
            dist.P2POp(dist.irecv, got, peer((r - (1 << k)) % n), group)])
        for w in works:
            w.wait()
    return math.ceil(math.log2(n)) if n > 1 else 0


def _check_one_host() -> None:
    if not os.path.isdir("/dev/shm"):
        raise RuntimeError("the shm all-reduce maps its buffers in /dev/shm, which this system does "
                           "not have (it needs Linux, or WSL on Windows): use 'ring' instead")
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is not None and world is not None and local != world:
        raise ValueError(f"shm all-reduce needs every rank on one host ({local} of {world} are "
                         f"here): use 'hierarchical' across hosts")


def _mapped(group, nbytes: int) -> tuple[list[torch.Tensor], int]:
    """Every rank's shared buffer (at least ``nbytes``), mapped into this process, and the
    barrier messages it took (none once mapped)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(n))
    key = (os.environ.get("MASTER_PORT", "0"), ranks)
    have = _buffers.get(key)
    if have is not None and have[0] >= nbytes:
        return have[1], 0
    cap = 1 << max(12, math.ceil(math.log2(max(nbytes, 1))))
    name = f"/dev/shm/dlab-{key[0]}-{'-'.join(map(str, ranks))}-{cap}-rank"
    with open(f"{name}{r}", "w+b") as f:
        f.truncate(cap)
    tokens = p2p_barrier(group)  # every file exists
    maps, views = [], []
    for j in range(n):
        with open(f"{name}{j}", "r+b") as f:
            mm = mmap.mmap(f.fileno(), cap)
        maps.append(mm)
        views.append(torch.frombuffer(mm, dtype=torch.uint8))
    tokens += p2p_barrier(group)  # every rank has mapped every file: the names can go
    os.unlink(f"{name}{r}")
    _buffers[key] = (cap, views, maps)
    return views, tokens


def shm_all_reduce(tensor, group=None, op="sum", trace=False):
    op = op_name(op)
    if op == "avg" and not tensor.is_floating_point():
        raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}: "
                         f"use op='sum' and divide yourself")
    _check_one_host()
    n, r = dist.get_world_size(group), dist.get_rank(group)
    size = tensor.numel() * tensor.element_size()
    report = Report("shm", r, n, size, chunks=n, rounds=2 if n > 1 else 0,
                    trace=[] if trace else None)
    if n == 1:
        return report
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    views, tokens = _mapped(group, size)
    bufs = [b[:size].view(tensor.dtype) for b in views]
    bounds = chunk_bounds(flat.numel(), n)
    mine = slice(bounds[r], bounds[r + 1])
    tokens += p2p_barrier(group)  # nobody still reads our buffer from the previous call
    bufs[r].copy_(flat)
    tokens += p2p_barrier(group)
    acc = bufs[r][mine]
    for j in range(n):  # fixed order 0..N-1 minus self: the same bits wherever a chunk is read
        if j != r:
            torch.maximum(acc, bufs[j][mine], out=acc) if op == "max" else acc.add_(bufs[j][mine])
    if op == "avg":
        acc.div_(n)
    tokens += p2p_barrier(group)
    for j in range(n):
        flat[bounds[j]:bounds[j + 1]] = bufs[j][bounds[j]:bounds[j + 1]]
    if not tensor.is_contiguous():  # we worked on a contiguous copy
        tensor.copy_(flat.view_as(tensor))
    chunk_bytes = [(bounds[j + 1] - bounds[j]) * tensor.element_size() for j in range(n)]
    report.steps = 2
    report.messages = 0
    # on the wire: only the barriers' 1-byte tokens, one sent and one received per round
    report.message_bytes = report.sent_pieces = report.recv_pieces = tokens
    # others read the other chunks of our buffer (step 2), then our reduced chunk (step 3);
    # we read our chunk of theirs, then their reduced chunks: the same total both ways
    report.sent_bytes = report.recv_bytes = size - chunk_bytes[r] + (n - 1) * chunk_bytes[r]
    if trace:
        report.trace = [Transfer(0, r, j, j, (r,), True) for j in range(n) if j != r] + \
                       [Transfer(1, r, j, r, tuple(range(n)), False) for j in range(n) if j != r]
    return report
