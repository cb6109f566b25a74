"""Hierarchical k-means with resampling (Vo et al., "Automatic Data Curation for Self-Supervised
Learning: A Clustering-Based Approach", TMLR 2024, arXiv 2405.15613, §3.1; facebookresearch/
ssl-data-curation ``hierarchical_kmeans_gpu.py``), on FAISS.

Level 1 clusters the training documents into ``levels[0]`` clusters; level t clusters the
centroids of level t-1 into ``levels[t-1]`` clusters. At every level, each of
``resampling_steps[t]`` resampling steps takes the ``sample_size[t]`` points closest to each
centroid (or random ones), runs k-means on that balanced sample alone, and re-assigns all points —
pulling centroids out of dense regions towards an even spread over concepts. Every level's labels
are kept: level 0 (``labels``) is the finest; ``levels[l-1]`` describes level l, with the ``parent``
map from level l-1's clusters. Samplers pick a level with ``sampler.level``.

:func:`balanced_selection` is the paper's hierarchical balanced sampling (§3.2): water-filling a
target size from the top level down.
"""
from __future__ import annotations

import logging

import numpy as np

from ccexp.clustering.kmeans import Clustering, assign, check_k, train_centroids, training_sample, use_gpu
from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


def _as_list(value, n: int, name: str) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) or hasattr(value, "__len__") else [value] * n
    if len(values) != n:
        raise CcexpError(f"clusterer.{name} needs one value per level ({n}), got {len(values)}")
    return [int(v) for v in values]


def closest_per_cluster(labels: np.ndarray, score: np.ndarray, k: int, per, rng=None) -> np.ndarray:
    """Indices of the ``per`` points with the highest ``score`` in each of the ``k`` clusters (random
    points when ``rng`` is given); ``per`` is one count or int[k], one per cluster. Vectorised: one
    lexsort, no loop over points."""
    key = rng.random(labels.size) if rng is not None else -np.asarray(score)
    order = np.lexsort((key, labels))
    sizes = np.bincount(labels, minlength=k)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank = np.arange(labels.size) - np.repeat(starts, sizes)
    quota = np.asarray(per)
    return order[rank < (quota[labels[order]] if quota.ndim else quota)]


class HierarchicalKMeans:
    """See the module docstring.

    Args:
        levels: clusters per level, finest first and decreasing, e.g. ``[1000, 100, 10]``.
        niter: Lloyd iterations per k-means.
        seed: FAISS seed and sampling seed.
        resampling_steps: per level (or one value for all).
        sample_size: points per cluster in a resampling step, per level (or one value).
        sampling: ``closest`` (the paper's default) or ``random``.
        selection_target: if set, keep only this many training documents, chosen by hierarchical
            balanced sampling (:func:`balanced_selection`) — a curation step before training.
        selection_strategy: ``random`` or ``closest`` (to the finest centroid) inside each cluster.
        max_points_per_centroid: level 1 trains on a seeded sample of ``levels[0] ·`` this many documents.
        spherical, assign_batch, device, verbose: as :class:`~ccexp.clustering.kmeans.FaissKMeans`.

    Raises:
        CcexpError: for levels that do not decrease, a level larger than its input, or bad options.
    """

    def __init__(self, levels=(32, 8), niter: int = 20, seed: int = 0, resampling_steps=0, sample_size=10,
                 sampling: str = "closest", max_points_per_centroid: int = 256, spherical: bool = True,
                 assign_batch: int = 65536, device: str = "auto", verbose: bool = False,
                 selection_target: int | None = None, selection_strategy: str = "random"):
        self.levels = [int(k) for k in levels]
        if selection_target is not None and int(selection_target) < 1:
            raise CcexpError(f"clusterer.selection_target must be >= 1, got {selection_target}")
        if selection_strategy not in ("random", "closest"):
            raise CcexpError(f"clusterer.selection_strategy={selection_strategy!r} is not an option; use random or closest")
        self.selection_target, self.selection_strategy = selection_target, selection_strategy
        if not self.levels or any(b >= a for a, b in zip(self.levels, self.levels[1:])):
            raise CcexpError(f"clusterer.levels={self.levels} must be non-empty and strictly decreasing "
                             "(finest level first)")
        self.resampling_steps = _as_list(resampling_steps, len(self.levels), "resampling_steps")
        self.sample_size = _as_list(sample_size, len(self.levels), "sample_size")
        if sampling not in ("closest", "random"):
            raise CcexpError(f"clusterer.sampling={sampling!r} is not an option; use closest or random")
        self.niter, self.seed, self.sampling = int(niter), int(seed), sampling
        self.max_points_per_centroid, self.spherical = int(max_points_per_centroid), bool(spherical)
        self.assign_batch, self.device, self.verbose = int(assign_batch), device, bool(verbose)

    def _level(self, points: np.ndarray, k: int, steps: int, per: int, seed: int, gpu: bool):
        """k-means with resampling on ``points``; returns centroids, point labels and scores."""
        kw = dict(niter=self.niter, spherical=self.spherical, gpu=gpu, verbose=self.verbose)
        centroids, objective = train_centroids(points, k, seed=seed, **kw)
        labels, score = assign(points, centroids, spherical=self.spherical, batch=self.assign_batch, gpu=gpu)
        rng = np.random.default_rng(seed) if self.sampling == "random" else None
        for step in range(steps):
            sample = closest_per_cluster(labels, score, k, per, rng)
            if sample.size < k:
                break  # too few points to re-fit k centroids
            centroids, objective = train_centroids(points[np.sort(sample)], k, seed=seed + step + 1, **kw)
            labels, score = assign(points, centroids, spherical=self.spherical, batch=self.assign_batch, gpu=gpu)
        return centroids, labels, score, objective

    def fit(self, embeddings: np.ndarray, train_mask: np.ndarray) -> Clustering:
        """Cluster ``embeddings[train_mask]`` level by level and label every document at every level."""
        train_idx = np.flatnonzero(train_mask)
        check_k(self.levels[0], train_idx.size, "clusterer.levels[0]")
        gpu = use_gpu(self.device)
        sample = training_sample(train_idx, self.levels[0] * self.max_points_per_centroid, self.seed)
        points = np.ascontiguousarray(embeddings[sample], dtype=np.float32)
        centroids, _, _, objective = self._level(points, self.levels[0], self.resampling_steps[0],
                                                 self.sample_size[0], self.seed, gpu)
        labels, score = assign(embeddings, centroids, spherical=self.spherical, batch=self.assign_batch, gpu=gpu)
        sizes = np.bincount(labels[train_idx], minlength=self.levels[0]).astype(np.int64)
        result = Clustering(labels, centroids, sizes, score, int(sample.size), objective)
        finer_centroids, finer_labels = centroids, labels
        for depth, k in enumerate(self.levels[1:], start=1):
            c, parent, _, _ = self._level(finer_centroids, k, self.resampling_steps[depth], self.sample_size[depth],
                                          self.seed + 1000 * depth, gpu)
            doc_labels = parent[finer_labels]
            sim = similarity_to(embeddings, c, doc_labels, self.assign_batch)
            result.levels.append({"labels": doc_labels.astype(np.int32), "centroids": c, "parent": parent,
                                  "sizes": np.bincount(doc_labels[train_idx], minlength=k).astype(np.int64),
                                  "similarity": sim})
            finer_centroids, finer_labels = c, doc_labels
        log.info("cluster: hierarchical k-means %s trained on %d of %d training documents (resampling %s)",
                 self.levels, sample.size, train_idx.size, self.resampling_steps)
        if self.selection_target is not None:
            result.selected = balanced_selection(
                [result.labels] + [lv["labels"] for lv in result.levels], self.levels,
                [lv["parent"] for lv in result.levels], np.asarray(train_mask, dtype=bool), result.similarity,
                int(self.selection_target), strategy=self.selection_strategy, seed=self.seed)
        return result


def similarity_to(embeddings: np.ndarray, centroids: np.ndarray, labels: np.ndarray, batch: int) -> np.ndarray:
    """float32[N]: inner product of each embedding with its assigned centroid, streamed in batches."""
    out = np.empty(labels.size, dtype=np.float32)
    for start in range(0, labels.size, batch):
        block = np.asarray(embeddings[start:start + batch], dtype=np.float32)
        out[start:start + block.shape[0]] = np.einsum("ij,ij->i", block, centroids[labels[start:start + batch]])
    return out


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


def balanced_selection(level_labels: list[np.ndarray], num_clusters: list[int], parents: list[np.ndarray],
                       train_mask: np.ndarray, similarity: np.ndarray, target: int, *, strategy: str = "random",
                       seed: int = 0) -> np.ndarray:
    """Hierarchical balanced sampling to ``target`` training documents (Vo et al. §3.2).

    Args:
        level_labels: int32[N] labels per level, finest first; num_clusters: K per level.
        parents: for each coarser level l >= 1, int32[K_{l-1}] mapping level l-1 clusters to level l.
        train_mask: bool[N]; only training documents are selected.
        similarity: float[N] similarity to the finest centroid (for ``strategy="closest"``).
        target: documents to keep.

    Returns:
        bool[N]: the selected documents.
    """
    if strategy not in ("random", "closest"):
        raise CcexpError(f"clusterer.selection.strategy={strategy!r} is not an option; use random or closest")
    rng = np.random.default_rng(seed)
    idx = np.flatnonzero(train_mask)
    sizes = [np.bincount(lab[idx], minlength=k) for lab, k in zip(level_labels, num_clusters)]
    top = len(level_labels) - 1
    quota = water_fill(sizes[top], target, rng)
    for level in range(top, 0, -1):  # push each cluster's quota down to its children
        parent = parents[level - 1]
        child_quota = np.zeros(parent.size, dtype=np.int64)
        for c in np.flatnonzero(quota):  # a loop over clusters, not documents
            kids = np.flatnonzero(parent == c)
            child_quota[kids] = water_fill(sizes[level - 1][kids], int(quota[c]), rng)
        quota = child_quota
    picked = closest_per_cluster(level_labels[0][idx], np.asarray(similarity)[idx], quota.size, quota,
                                 rng if strategy == "random" else None)
    selected = np.zeros(train_mask.size, dtype=bool)
    selected[idx[picked]] = True
    return selected
