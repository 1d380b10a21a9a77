"""Expert parallelism: bytes a rank sends per step, given the routing.

Per MoE layer and step, with ``sent`` rows this rank routes to experts on other ranks and
``received`` rows it gets from them (a row is one token for one of its top-k experts), width d:

    counts                     (n-1) x 8          the all-to-all of row counts (int64)
    rows out + their experts   sent x (4d + 8)
    answers back               received x 4d
    backward                   sent x 4d + received x 4d   (each all-to-all reversed)

plus the data-parallel all-reduce of the dense (non-expert) gradients, 2 (n-1)/n x P_dense.
Under uniform routing sent = received = tokens x k x (n-1)/n per rank, so the all-to-all bytes
grow with tokens and k, not with the number of experts.
"""
from __future__ import annotations


def all_to_all_bytes(n: int, d_model: int, sent: int, received: int, bytes_per: int = 4) -> int:
    return (n - 1) * 8 + sent * (2 * d_model * bytes_per + 8) + received * 2 * d_model * bytes_per


def uniform_rows(tokens: int, k: int, n: int) -> float:
    """Rows one rank sends off-rank per layer if the router spread tokens evenly."""
    return tokens * k * (n - 1) / n
