"""Cut a sequence of blocks into contiguous stages of balanced cost.

Balanced by FLOPs, not by layer count: the seed MLP's first layer holds 66 % of its
parameters, so an equal-layer cut leaves one stage doing almost all the work. FLOPs (not
measured time) keep the cut identical on every rank without a collective.
"""

from __future__ import annotations

from itertools import accumulate


def balanced_cuts(costs: list[int], stages: int) -> list[tuple[int, int]]:
    """Split `costs` into `stages` contiguous non-empty ranges [lo, hi) minimising the
    largest range sum (the pipeline's bottleneck stage). Exact dynamic programme,
    O(stages * len(costs)^2), which is nothing for models of tens of blocks."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} non-empty stages")
    prefix = [0, *accumulate(costs)]
    inf = float("inf")
    # best[s][i]: smallest bottleneck putting the first i blocks into s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                cand = max(best[s - 1][j], prefix[i] - prefix[j])
                if cand < best[s][i]:  # strict: ties keep the earliest cut, deterministic
                    best[s][i], back[s][i] = cand, j
    cuts, i = [], n
    for s in range(stages, 0, -1):
        j = back[s][i]
        cuts.append((j, i))
        i = j
    return cuts[::-1]
