"""The alpha-beta (latency-bandwidth) model of communication (Hockney 1994).

Sending a message of ``n`` bytes costs ``alpha + n * beta``: ``alpha`` is the fixed start-up
cost (software overhead, link latency), ``beta`` the seconds per byte (1 / bandwidth). A
collective algorithm is then a count of steps and of bytes on its critical path, e.g. the ring
all-reduce of ``S`` bytes on ``N`` ranks takes ``2 (N-1)`` steps, each moving ``S / N`` bytes:

    T_ring = 2 (N-1) alpha + 2 (N-1)/N * S * beta        (Patarasuk & Yuan 2009)

Algorithm and bus bandwidth follow nccl-tests: algbw = S / T, busbw = algbw * 2 (N-1)/N for
all-reduce, so a bandwidth-optimal all-reduce shows busbw equal to the link bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    """A link: ``alpha`` seconds per message (a ring step), ``beta`` seconds per byte. The one
    link type of the lab's fits and of the planner's clusters."""
    alpha: float  # seconds per message
    beta: float  # seconds per byte

    @classmethod
    def link(cls, bandwidth: float, alpha: float) -> AlphaBeta:
        """A link of ``bandwidth`` bytes per second and ``alpha`` seconds per message."""
        return cls(alpha, 1.0 / bandwidth)

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.alpha + nbytes * self.beta

    @property
    def bandwidth(self) -> float:
        return 1.0 / self.beta


def fit_alpha_beta(sizes: list[float], seconds: list[float], steps: float = 1.0,
                   bytes_factor: float = 1.0, relative: bool = False) -> AlphaBeta:
    """Least-squares fit of ``t = steps * alpha + bytes_factor * size * beta`` to measurements.

    For a ring all-reduce pass ``steps = 2 (N-1)`` and ``bytes_factor = 2 (N-1)/N``, so the
    fitted alpha and beta are per message and per byte on one link, comparable across ``N``.
    ``relative=True`` minimises relative rather than absolute error: over sizes spanning
    decades, an absolute fit lets the largest message decide everything and alpha comes out
    as noise (or zero); the relative fit keeps the small messages' say on alpha.
    """
    x = np.asarray(sizes, dtype=float) * bytes_factor
    t = np.asarray(seconds, dtype=float)
    a = np.stack([np.full_like(x, steps), x], axis=1)
    w = 1.0 / t if relative else np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    return AlphaBeta(max(float(alpha), 0.0), max(float(beta), 1e-15))


def ring_allreduce_time(nbytes: float, world_size: int, link: AlphaBeta) -> float:
    """The ring all-reduce of ``nbytes``: 2 (N-1) steps of S/N bytes."""
    n = world_size
    return link.time(2 * (n - 1) / n * nbytes, messages=2 * (n - 1)) if n > 1 else 0.0


def ring_gather_time(nbytes: float, world_size: int, link: AlphaBeta) -> float:
    """The ring all-gather (or reduce-scatter) whose whole buffer is ``nbytes``: N-1 steps."""
    n = world_size
    return link.time((n - 1) / n * nbytes, messages=n - 1) if n > 1 else 0.0


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2 (N-1)/N."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size


# --- per-algorithm formulas (dlab.comm.algorithms) ---------------------------------------------
# Each all-reduce is a schedule of ``rounds`` steps; its time is rounds * alpha plus the bytes
# on its critical path (the busiest link, in schedule order) times beta. ``sent_bytes`` is what
# one rank sends, exactly, when the vector splits evenly (into N chunks for the ring, 2^k
# blocks for Rabenseifner, node_size chunks of N/node_size pieces for the hierarchical one).

ALLREDUCE_ALGORITHMS = ("naive", "ps", "ring", "tree", "recursive-doubling", "rabenseifner",
                        "hierarchical", "shm")


def _log2_floor(n: int) -> int:
    return n.bit_length() - 1


def _default_node_size(n: int, node_size: int | None) -> int:
    if node_size is not None:
        return node_size
    return 2 if n % 2 == 0 and n > 2 else n


def tree_pieces(nbytes: float, piece_bytes: int = 1 << 20) -> int:
    return max(1, math.ceil(nbytes / piece_bytes))


def allreduce_rounds(algorithm: str, world_size: int, nbytes: float = 0, *,
                     node_size: int | None = None, piece_bytes: int = 1 << 20) -> int:
    """Steps in the algorithm's schedule: the alpha count."""
    n = world_size
    if n == 1:
        return 0
    p2, extra = 1 << _log2_floor(n), n - (1 << _log2_floor(n))
    fold = 2 if extra else 0  # the non-power-of-two fold-in and hand-back steps
    if algorithm == "naive":
        return 2 * (n - 1)
    if algorithm in ("ps", "shm"):
        return 2
    if algorithm in ("ring", "gloo"):
        return 2 * (n - 1)
    if algorithm == "tree":
        return tree_pieces(nbytes, piece_bytes) + 2 * _log2_floor(n) - 1
    if algorithm == "recursive-doubling":
        return _log2_floor(p2) + fold
    if algorithm == "rabenseifner":
        return 2 * _log2_floor(p2) + fold
    if algorithm == "hierarchical":
        k = _default_node_size(n, node_size)
        return 2 * (k - 1) + 2 * (n // k - 1)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; known: {ALLREDUCE_ALGORITHMS}")


def allreduce_path_bytes(algorithm: str, nbytes: float, world_size: int, *,
                         node_size: int | None = None, piece_bytes: int = 1 << 20) -> float:
    """Bytes on the critical path: what the busiest rank sends, one message after another."""
    n, s = world_size, float(nbytes)
    if n == 1:
        return 0.0
    p2, extra = 1 << _log2_floor(n), n - (1 << _log2_floor(n))
    fold = 2 * s if extra else 0.0
    if algorithm in ("naive", "ps"):
        return 2 * (n - 1) * s
    if algorithm in ("ring", "gloo"):
        return 2 * (n - 1) / n * s
    if algorithm == "tree":
        pieces = tree_pieces(nbytes, piece_bytes)
        return allreduce_rounds("tree", n, nbytes, piece_bytes=piece_bytes) * min(2, n - 1) * s / pieces
    if algorithm == "recursive-doubling":
        return _log2_floor(p2) * s + fold
    if algorithm == "rabenseifner":
        return 2 * (p2 - 1) / p2 * s + fold
    if algorithm == "hierarchical":
        k = _default_node_size(n, node_size)
        m = n // k
        return 2 * (k - 1) / k * s + 2 * (m - 1) / m * s / k
    if algorithm == "shm":  # bytes copied in memory: copy in, fold (N-1)/N S at ~1.5 copies, copy out
        return (2 + 1.5 * (n - 1) / n) * s
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; known: {ALLREDUCE_ALGORITHMS}")


def allreduce_time(algorithm: str, nbytes: float, world_size: int, link: AlphaBeta,
                   memory: AlphaBeta | None = None, **options) -> float:
    """Predicted seconds: rounds * alpha + critical-path bytes * beta ("gloo" = its ring).

    "shm" moves its data by memory copies, not messages: its bytes are priced at ``memory``'s
    beta (seconds per byte copied; ``link``'s if not given) and its alphas are the three
    dissemination barriers of ceil(log2 N) messages each.
    """
    if algorithm == "shm":
        barriers = 3 * math.ceil(math.log2(world_size)) if world_size > 1 else 0
        return barriers * link.alpha + allreduce_path_bytes("shm", nbytes, world_size) * (memory or link).beta
    return link.time(allreduce_path_bytes(algorithm, nbytes, world_size, **options),
                     messages=allreduce_rounds(algorithm, world_size, nbytes, **options))


def allreduce_sent_bytes(algorithm: str, nbytes: float, world_size: int, rank: int, *,
                         node_size: int | None = None) -> float:
    """Bytes one rank sends (= receives, for every algorithm here) for an evenly split vector."""
    n, s = world_size, float(nbytes)
    if n == 1:
        return 0.0
    p2, extra = 1 << _log2_floor(n), n - (1 << _log2_floor(n))
    folded = rank < 2 * extra  # takes part in the fold-in / hand-back (sends S once)
    active = not (folded and rank % 2 == 0)  # runs the power-of-two part
    if algorithm in ("naive", "ps"):
        return (n - 1) * s if rank == 0 else s
    if algorithm in ("ring", "shm"):  # shm: bytes other ranks read from this rank's buffer
        return 2 * (n - 1) / n * s
    if algorithm == "tree":
        children = sum(c < n for c in (2 * rank + 1, 2 * rank + 2))
        return (children + (rank > 0)) * s
    if algorithm == "recursive-doubling":
        return active * _log2_floor(p2) * s + folded * s
    if algorithm == "rabenseifner":
        return active * 2 * (p2 - 1) / p2 * s + folded * s
    if algorithm == "hierarchical":
        k = _default_node_size(n, node_size)
        m = n // k
        return 2 * (k - 1) / k * s + 2 * (m - 1) / m * s / k
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; known: {ALLREDUCE_ALGORITHMS}")
