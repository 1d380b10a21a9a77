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

from dataclasses import dataclass

import numpy as np


@dataclass
class AlphaBeta:
    alpha: float  # seconds per message
    beta: float  # seconds per byte

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.alpha + nbytes * self.beta

    @property
    def bandwidth(self) -> float:
        return 1.0 / self.beta


def fit_alpha_beta(sizes: list[float], seconds: list[float], steps: float = 1.0,
                   bytes_factor: float = 1.0) -> AlphaBeta:
    """Least-squares fit of ``t = steps * alpha + bytes_factor * size * beta`` to measurements.

    For a ring all-reduce pass ``steps = 2 (N-1)`` and ``bytes_factor = 2 (N-1)/N``, so the
    fitted alpha and beta are per message and per byte on one link, comparable across ``N``.
    """
    x = np.asarray(sizes, dtype=float) * bytes_factor
    a = np.stack([np.full_like(x, steps), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.asarray(seconds, dtype=float), rcond=None)
    return AlphaBeta(max(float(alpha), 0.0), max(float(beta), 1e-15))


def ring_allreduce_time(nbytes: float, world_size: int, link: AlphaBeta) -> float:
    n = world_size
    return link.time(2 * (n - 1) / n * nbytes, messages=2 * (n - 1)) if n > 1 else 0.0


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2 (N-1)/N."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size
