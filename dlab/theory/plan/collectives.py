"""What a collective costs on a cluster: bus bandwidth as achieved, by message size, group and
link level (nccl-tests' convention: an all-reduce of S bytes over n ranks moves 2 (n-1)/n S
"bus bytes" per rank, an all-gather or reduce-scatter of an S-byte buffer (n-1)/n S).

A collective of S bytes takes ``steps x latency + bus bytes / busbw``: below ``steps x
latency x busbw`` bus bytes it is latency-bound (its achieved bus bandwidth grows with S),
above it it runs at the level's bus bandwidth (line rate times what NCCL achieves of it).
The steps are a ring's (2 (n-1) for an all-reduce, n-1 for the others, 1 for a send), or for
an all-reduce a tree's 2 log2 n where fewer. The two levels (``Cluster.intra``, ``Cluster.inter``: latency
per step and bus bandwidth):

- inside a node, NVLink through NVSwitch: nccl-tests' all-reduce bus bandwidth, 232 GB/s on a
  DGX A100 and 370 GB/s on a DGX H100 (480 with NVLink SHARP), NVIDIA, GTC 2024 session S62129
  ("NCCL Tests Allreduce Bus Bandwidth"), as reproduced in Bekman's Machine Learning
  Engineering, network/benchmarks;
- across nodes, a GPU's own NIC: 24 GB/s for 200 Gb/s HDR, 48 GB/s for 400 Gb/s NDR (the same
  slide). A group with k members in each node drives k NICs at once (the rail-optimised DGX
  design: NCCL's rings and its hierarchical all-reduce keep every NIC of the node busy), so its
  bus bandwidth is ``min(intra, k x inter)``: 8 x 24 = 192 GB/s is the slide's DGX A100
  all-reduce across nodes, 8 x 48 = 384 its DGX H100's 380. A data-parallel group under tp = 8
  has one member per node and gets one NIC's 48; under tp = 1 it has eight.

Ranks fill a node before the next (``gpus_per_node`` of them), and a dimension's group takes
every ``stride``-th rank (``PlanLayout.span``: tp innermost), so a group of n ranks at stride
``stride`` lies inside one node when ``n x stride <= gpus_per_node``, and otherwise has
``gpus_per_node / stride`` members in each node (at least one).

The all-to-all sends (n-1)/n of its buffer, the part bound for other nodes over the NICs and
the rest over NVLink; a point-to-point transfer (a pipeline's send) moves its bytes over one
link. A calibrated profile (``python -m dlab plan calibrate``) states its own latency and bus
bandwidth per operation (``Cluster.ops``), which replace these.
"""
from __future__ import annotations

import math

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def bus_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes a rank moves on the bus for one ``op`` of an ``nbytes`` buffer over ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op == "p2p":
        return nbytes
    return (n - 1) / n * nbytes


def steps(op: str, n: int) -> int:
    """Latency-bound steps of ``op`` over ``n`` ranks: a ring's; for an all-reduce a tree's
    2 log2 n where those are fewer (NCCL's tuner takes its tree where the ring's latency would
    dominate; its all-gather and reduce-scatter are rings)."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    return 1 if op == "p2p" else n - 1


def placement(cluster, n: int, stride: int) -> int:
    """Members per node of a group of ``n`` ranks ``stride`` apart; 0 when it lies in one node."""
    if n * stride <= cluster.gpus_per_node:
        return 0
    return max(1, min(n, cluster.gpus_per_node // stride))


def link(cluster, op: str, n: int, stride: int) -> tuple[float, float]:
    """(latency per step, bus bandwidth) of ``op`` over ``n`` ranks ``stride`` apart."""
    per_node = placement(cluster, n, stride)
    level = "intra" if per_node == 0 else "inter"
    for name, lvl, latency, busbw in cluster.ops:
        if name == op and lvl == level:
            return latency, busbw
    if per_node == 0:
        return cluster.intra.alpha, cluster.intra.bandwidth
    if op in ("p2p", "all_to_all"):
        return cluster.inter.alpha, cluster.inter.bandwidth
    return cluster.inter.alpha, min(cluster.intra.bandwidth, per_node * cluster.inter.bandwidth)


def collective_time(cluster, op: str, nbytes: float, n: int, stride: int = 1,
                    bandwidth_scale: float = 1.0) -> float:
    """Seconds of one ``op`` of an ``nbytes`` buffer over ``n`` ranks ``stride`` apart
    (module docstring). ``bandwidth_scale`` scales the bus bandwidth (the spread of
    ``dlab.theory.plan.ranges``)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    latency, busbw = link(cluster, op, n, stride)
    busbw *= bandwidth_scale
    per_node = placement(cluster, n, stride)
    if op == "all_to_all" and per_node:  # the other nodes' share over the NICs, the rest NVLink
        inside = (per_node - 1) / n * nbytes
        across = (n - per_node) / n * nbytes
        return steps(op, n) * latency + across / busbw + inside / cluster.intra.bandwidth
    return steps(op, n) * latency + bus_bytes(op, nbytes, n) / busbw


def achieved_busbw(cluster, op: str, nbytes: float, n: int, stride: int = 1) -> float:
    """The bus bandwidth ``op`` achieves at ``nbytes`` (nccl-tests' busbw column)."""
    return bus_bytes(op, nbytes, n) / collective_time(cluster, op, nbytes, n, stride)
