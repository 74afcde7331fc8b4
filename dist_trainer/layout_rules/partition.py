"""The stage split both stack shapes share: consecutive layers onto stages, the costliest stage smallest.
Torch-free."""

from __future__ import annotations

from collections.abc import Callable


def min_max_split(n: int, num_stages: int, stage_cost: Callable[[int, int, int], float]) -> list[int]:
    """Layers per stage cutting ``n`` layers into ``num_stages`` non-empty runs that minimise the costliest stage;
    ``stage_cost(s, j, k)``: layers [j, k) as stage s (1-based), ``inf`` for a run no stage may hold. Ties keep the
    earliest cut (dynamic programming over the prefixes, O(stages x n^2))."""
    inf = float("inf")
    best: list[list[float]] = [[inf] * (n + 1) for _ in range(num_stages + 1)]  # first k layers on s stages
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for k in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, k):
                worst = max(best[s - 1][j], stage_cost(s, j, k))
                if worst < best[s][k]:
                    best[s][k], cut[s][k] = worst, j
    counts, k = [], n
    for s in range(num_stages, 0, -1):
        counts.append(k - cut[s][k])
        k = cut[s][k]
    return counts[::-1]
