"""Balanced selection: keep a target number of training documents, spread as evenly as the
clustering allows (Vo et al., "Automatic Data Curation for Self-Supervised Learning: A
Clustering-Based Approach", TMLR 2024, arXiv 2405.15613, §3.2, hierarchical balanced sampling).

A curation step of its own, after clustering and before sampling: the target is water-filled over
the coarsest level's clusters, each cluster's share is pushed down to its children level by level,
and inside each finest cluster the documents are taken at random or closest to the centroid. With a
flat clustering it is a water-fill over its clusters.
"""
from __future__ import annotations

import numpy as np

from ccexp.errors import CcexpError


def closest_per_cluster(labels: np.ndarray, score: np.ndarray, k: int, per, rng=None) -> np.ndarray:
    """Indices of the ``per`` points with the highest ``score`` in each of the ``k`` clusters (random
    points when ``rng`` is given), grouped by cluster, highest score first; ``per`` is one count or
    int[k], one per cluster. Vectorised: one lexsort, no loop over points."""
    key = rng.random(labels.size) if rng is not None else -np.asarray(score)
    order = np.lexsort((key, labels))
    sizes = np.bincount(labels, minlength=k)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank = np.arange(labels.size) - np.repeat(starts, sizes)
    quota = np.asarray(per)
    return order[rank < (quota[labels[order]] if quota.ndim else quota)]


def water_fill(sizes: np.ndarray, target: int, rng: np.random.Generator) -> np.ndarray:
    """Targets t_c with Σ t_c = min(target, Σ sizes): clusters with s_c <= x are taken whole, the
    others get x or x+1, where x is the largest cap with Σ min(x, s_c) <= target (Vo et al. §3.2)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if target >= sizes.sum():
        return sizes.copy()
    lo, hi = 0, int(sizes.max())
    while lo < hi:  # the largest x with sum(min(x, s)) <= target
        mid = (lo + hi + 1) // 2
        if np.minimum(mid, sizes).sum() <= target:
            lo = mid
        else:
            hi = mid - 1
    out = np.minimum(lo, sizes)
    rest = int(target - out.sum())
    if rest:
        candidates = np.flatnonzero(sizes > lo)
        out[rng.choice(candidates, rest, replace=False)] += 1
    return out


def check_strategy(strategy: str) -> None:
    """Raises CcexpError unless ``strategy`` is ``random`` or ``closest``."""
    if strategy not in ("random", "closest"):
        raise CcexpError(f"selection.strategy={strategy!r} is not an option; use random or closest")


def balanced_selection(levels: list, train_mask: np.ndarray, target: int, *, strategy: str = "random",
                       seed: int = 0) -> np.ndarray:
    """Hierarchical balanced sampling to ``target`` training documents (Vo et al. §3.2).

    Args:
        levels: the clustering's levels ([`Level`][ccexp.clustering.kmeans.Level]), finest first; each
            coarser one carries ``parent``, mapping the previous level's clusters to its own.
        train_mask: bool[N]; only training documents are selected.
        target: documents to keep (>= 1).
        strategy: inside each finest cluster, ``random`` documents or the ``closest`` to the centroid
            (highest cosine similarity).
        seed: for the water-fill's ties and the random picks.

    Returns:
        bool[N]: the selected documents.

    Raises:
        CcexpError: for an unknown strategy or a target below 1.
    """
    check_strategy(strategy)
    if int(target) < 1:
        raise CcexpError(f"selection.target must be >= 1, got {target}")
    rng = np.random.default_rng(seed)
    idx = np.flatnonzero(train_mask)
    sizes = [np.bincount(lv.labels[idx], minlength=lv.k) for lv in levels]
    top = len(levels) - 1
    quota = water_fill(sizes[top], int(target), rng)
    for level in range(top, 0, -1):  # push each cluster's quota down to its children
        parent = levels[level].parent
        child_quota = np.zeros(parent.size, dtype=np.int64)
        for c in np.flatnonzero(quota):  # a loop over clusters, not documents
            kids = np.flatnonzero(parent == c)
            child_quota[kids] = water_fill(sizes[level - 1][kids], int(quota[c]), rng)
        quota = child_quota
    finest = levels[0]
    picked = closest_per_cluster(finest.labels[idx], np.asarray(finest.similarity)[idx], quota.size, quota,
                                 rng if strategy == "random" else None)
    selected = np.zeros(train_mask.size, dtype=bool)
    selected[idx[picked]] = True
    return selected
