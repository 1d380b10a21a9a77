"""Context parallelism: bytes each rank sends per step, and the causal work per rank.

With n ranks, a batch of b sequences of s tokens, width h and L layers (NOTATION.md), one rank's K and V of
one layer are kv = 2 b (s/n) h * 4 bytes (fp32). Per layer and step a rank sends:

    allgather   (n-1) kv  (all-gather, forward)  + (n-1) kv  (reduce-scatter of dK, dV)
    ring        (n-1) kv  (blocks, forward)      + (n-1) kv  (blocks again, backward)
                                                 +   n   kv  (dK, dV accumulators, n hops home)
    ulysses     (n-1)/n 2 kv (Q, K, V to heads,  + (n-1)/n 2 kv (their gradients, the
                the output back: 1.5 + 0.5 kv)                   reverse all-to-alls)
    usp         Ulysses' 4 (u-1)/u kv inside groups of u ranks + the ring's (3r - 2) kv over
                r = n/u groups (a ring block is 1/u of the heads of u ranks' tokens: kv again)

and, as in data parallelism, 2 (W-1)/W P for the gradients of P parameter bytes over all W
ranks (W = n, or n x dp under CP x DP). The ring
sends 1.5x the all-gather's K/V bytes (asymptotically) but keeps one rank's memory at s/n;
Ulysses sends 4 (n-1)/n kv, under 4 kv at any n, where the other two grow as n kv.
"""
from __future__ import annotations


def kv_bytes(batch: int, seq_len: int, d_model: int, n: int, bytes_per: int = 4) -> int:
    return 2 * batch * (seq_len // n) * d_model * bytes_per


def layer_bytes(attention: str, n: int, kv: float, ulysses: int = 1) -> float:
    """Bytes one rank sends per layer and step for its attention over ``n`` ranks (``ulysses``:
    USP's group size)."""
    if attention == "usp":
        return layer_bytes("ulysses", ulysses, kv) + layer_bytes("ring", n // ulysses, kv)
    return {"allgather": 2 * (n - 1) * kv, "ring": (3 * n - 2) * kv if n > 1 else 0,
            "ulysses": 4 * (n - 1) * kv / n}[attention]


def forward_bytes(attention: str, n: int, kv: float, ulysses: int = 1) -> float:
    """The forward share of ``layer_bytes``: what a recomputed attention core sends again."""
    if attention == "usp":
        return forward_bytes("ulysses", ulysses, kv) + forward_bytes("ring", n // ulysses, kv)
    return {"allgather": (n - 1) * kv, "ring": (n - 1) * kv, "ulysses": 2 * (n - 1) * kv / n}[attention]


def sent_per_step(attention: str, n: int, n_layer: int, kv: int, param_bytes: int,
                  world: int | None = None, ulysses: int = 1) -> float:
    """``n`` ranks share each sequence; the gradient all-reduce spans all ``world`` ranks
    (``n`` times the data-parallel degree; default ``n``). ``kv`` is for one rank's share of its
    replica's batch."""
    world = world or n
    return n_layer * layer_bytes(attention, n, kv, ulysses) + 2 * (world - 1) / world * param_bytes
