"""Which token positions each rank of a context-parallel group holds.

``contiguous``: rank r holds positions [r T/n, (r+1) T/n). Under a causal mask this is lopsided:
rank r's queries see r + 1 of the n key blocks (the diagonal one half), so rank n-1 does about
2n - 1 times the attention work of rank 0, and every ring step waits for the busiest rank.

``zigzag``: the sequence is cut into 2n chunks and rank r holds chunks r and 2n-1-r, an early
and a late one, so every rank's queries see the same number of keys (the load balancing of
Llama 3's context parallelism, Dubey et al. 2024, sec. 3.3.2; also Brandon et al. 2023,
"Striped Attention").
"""
from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def chunks(layout: str, n: int) -> int:
    """How many equal pieces the sequence is cut into (seq_len must divide by it)."""
    return 2 * n if layout == "zigzag" else n


def positions(layout: str, seq_len: int, rank: int, n: int) -> torch.Tensor:
    """The positions rank ``rank`` holds, in the order it holds them (increasing)."""
    size = seq_len // chunks(layout, n)
    if layout == "zigzag":
        mine = [rank, 2 * n - 1 - rank]
    else:
        mine = [rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in mine])


def visible_pairs(layout: str, seq_len: int, rank: int, n: int) -> int:
    """(query, key) pairs this rank's queries attend to under the causal mask: its share of
    the attention FLOPs."""
    q = positions(layout, seq_len, rank, n)
    return sum(int((q[:, None] >= positions(layout, seq_len, s, n)[None, :]).sum()) for s in range(n))
