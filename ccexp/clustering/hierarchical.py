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

The paper's hierarchical balanced sampling (§3.2) is its own step, [`ccexp.clustering.selection`][ccexp.clustering.selection].
"""
from __future__ import annotations

import logging

import numpy as np

from ccexp.clustering.kmeans import (Clustering, Level, assign, check_k, cosine_to, train_centroids, training_sample,
                                    use_gpu)
from ccexp.clustering.selection import closest_per_cluster
from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


def _as_list(value, n: int, name: str) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) or hasattr(value, "__len__") else [value] * n
    if len(values) != n:
        raise CcexpError(f"clusterer.{name} needs one value per level ({n}), got {len(values)}")
    return [int(v) for v in values]


class HierarchicalKMeans:
    """See the module docstring.

    Args:
        levels: clusters per level, finest first and decreasing, e.g. ``[1000, 100, 10]``.
        niter: Lloyd iterations per k-means.
        seed: FAISS seed and sampling seed.
        resampling_steps: per level (or one value for all).
        sample_size: points per cluster in a resampling step, per level (or one value).
        sampling: ``closest`` (highest cosine similarity to the centroid; the paper's default) or ``random``.
        max_points_per_centroid: level 1 trains on a seeded sample of ``levels[0] ·`` this many documents.
        spherical: as [`FaissKMeans`][ccexp.clustering.kmeans.FaissKMeans].
        assign_batch: as [`FaissKMeans`][ccexp.clustering.kmeans.FaissKMeans].
        device: as [`FaissKMeans`][ccexp.clustering.kmeans.FaissKMeans].
        verbose: as [`FaissKMeans`][ccexp.clustering.kmeans.FaissKMeans].

    Raises:
        CcexpError: for levels that do not decrease, a level larger than its input, or bad options.
    """

    def __init__(self, levels=(128, 32, 8), niter: int = 20, seed: int = 0, resampling_steps=0, sample_size=10,
                 sampling: str = "closest", max_points_per_centroid: int = 256, spherical: bool = True,
                 assign_batch: int = 65536, device: str = "auto", verbose: bool = False):
        self.levels = [int(k) for k in levels]
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
        """k-means with resampling on ``points``; returns centroids, point labels and their cosine
        similarity to the centroid, and the objective."""
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
        labels, similarity = assign(embeddings, centroids, spherical=self.spherical, batch=self.assign_batch, gpu=gpu)
        sizes = np.bincount(labels[train_idx], minlength=self.levels[0]).astype(np.int64)
        result = Clustering([Level(labels, centroids, sizes, similarity)], int(sample.size), objective)
        finer = result.levels[0]
        for depth, k in enumerate(self.levels[1:], start=1):
            c, parent, _, _ = self._level(finer.centroids, k, self.resampling_steps[depth], self.sample_size[depth],
                                          self.seed + 1000 * depth, gpu)
            doc_labels = parent[finer.labels].astype(np.int32)
            finer = Level(doc_labels, c, np.bincount(doc_labels[train_idx], minlength=k).astype(np.int64),
                          _similarity(embeddings, c, doc_labels, self.assign_batch), parent)
            result.levels.append(finer)
        log.info("cluster: hierarchical k-means %s trained on %d of %d training documents (resampling %s)",
                 self.levels, sample.size, train_idx.size, self.resampling_steps)
        return result


def _similarity(embeddings: np.ndarray, centroids: np.ndarray, labels: np.ndarray, batch: int) -> np.ndarray:
    """float32[N]: cosine similarity of each embedding to its assigned centroid, streamed in batches."""
    out = np.empty(labels.size, dtype=np.float32)
    for start in range(0, labels.size, batch):
        block = np.asarray(embeddings[start:start + batch], dtype=np.float32)
        out[start:start + block.shape[0]] = cosine_to(block, centroids, labels[start:start + batch])
    return out


