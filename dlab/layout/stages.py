"""Which blocks each pipeline stage holds: contiguous runs chosen to minimise the most loaded
stage (the pipeline goes as fast as its slowest stage), a block's load being its parameter
count or its measured time (``dlab.parallel.pipeline.split`` measures them). Pure arithmetic:
the strategies cut the model with it, and the formulas count each stage's parameters with it.
"""
from __future__ import annotations


def partition(costs: list[float], n_stages: int, first_extra: float = 0.0,
              last_extra: float = 0.0) -> list[range]:
    """Contiguous runs of blocks, one per stage (each at least one block), minimising the
    largest stage load; ``first_extra`` / ``last_extra`` load stage 0 (embedding) and the last
    stage (head, loss). Exact by dynamic programming over cut points: O(n_stages L^2)."""
    n = len(costs)
    if n_stages > n:
        raise ValueError(f"{n_stages} stages need at least {n_stages} transformer blocks "
                         f"(n_layer={n}); raise n_layer or use fewer stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def load(stage: int, i: int, j: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == n_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[s][j]: the smallest possible max load placing blocks [0, j) on stages [0, s)
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], load(s - 1, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    bounds, j = [], n
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]
