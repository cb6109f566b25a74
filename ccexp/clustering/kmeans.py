"""Flat spherical k-means on FAISS (the clustering step of ClusterClip, Shao et al. 2024, §3.1).

Centroids are trained on the training documents' embeddings (L2-normalised, so inner product =
cosine similarity; ``spherical=True`` re-normalises centroids each iteration, as the ClusterClip
repository's ``kmeans.py`` does). FAISS silently subsamples to ``k · max_points_per_centroid``
points; ccexp draws that sample itself, with the run's seed, and logs its size. Every document —
training and held-out — is then assigned to its nearest centroid in batches.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


@dataclass
class Clustering:
    """labels int32[N] (all documents), centroids float32[K, d], sizes int64[K] (training documents
    per cluster), similarity float32[N] (cosine similarity to the assigned centroid), and the number
    of points that trained the centroids."""

    labels: np.ndarray
    centroids: np.ndarray
    sizes: np.ndarray
    similarity: np.ndarray
    train_points: int
    objective: float


class FaissKMeans:
    """Spherical k-means with FAISS.

    Args:
        k: number of clusters K (``1 <= K <=`` training documents).
        niter: Lloyd iterations.
        seed: FAISS seed, also used to draw the training sample.
        max_points_per_centroid: train on at most ``K ·`` this many points (a seeded sample).
        spherical: normalise centroids (cosine k-means).
        nredo: restarts; the best objective is kept.
        assign_batch: vectors per assignment batch.
        verbose: FAISS's per-iteration log.
    """

    def __init__(self, k: int = 32, niter: int = 20, seed: int = 0, max_points_per_centroid: int = 256,
                 spherical: bool = True, nredo: int = 1, assign_batch: int = 65536, verbose: bool = False):
        self.k, self.niter, self.seed = int(k), int(niter), int(seed)
        self.max_points_per_centroid = int(max_points_per_centroid)
        self.spherical, self.nredo = bool(spherical), int(nredo)
        self.assign_batch, self.verbose = int(assign_batch), bool(verbose)

    def fit(self, embeddings: np.ndarray, train_mask: np.ndarray) -> Clustering:
        """Train centroids on ``embeddings[train_mask]`` and assign every row.

        Args:
            embeddings: float32[N, d] (may be a memory map).
            train_mask: bool[N], True for the documents that train the centroids and count in sizes.

        Raises:
            CcexpError: if K exceeds the training documents, K < 1, or an embedding is not finite.
        """
        import faiss

        train_idx = np.flatnonzero(train_mask)
        if self.k < 1:
            raise CcexpError(f"clusterer.k must be >= 1, got {self.k}")
        if self.k > train_idx.size:
            raise CcexpError(f"clusterer.k={self.k} is larger than the {train_idx.size} training documents; "
                             f"set clusterer.k <= {train_idx.size}")
        cap = self.k * self.max_points_per_centroid
        rng = np.random.default_rng(self.seed)
        sample = np.sort(rng.choice(train_idx, cap, replace=False)) if train_idx.size > cap else train_idx
        x = np.ascontiguousarray(embeddings[sample], dtype=np.float32)
        if not np.isfinite(x).all():
            raise CcexpError("clusterer: the embeddings contain NaN or inf; re-run the embed stage")
        d = x.shape[1]
        km = faiss.Kmeans(d, self.k, niter=self.niter, seed=self.seed, spherical=self.spherical, nredo=self.nredo,
                          max_points_per_centroid=max(self.max_points_per_centroid, -(-x.shape[0] // self.k)),
                          min_points_per_centroid=1, verbose=self.verbose)
        km.train(x)
        log.info("cluster: k-means trained on %d of %d training documents (K=%d, %d iterations)",
                 x.shape[0], train_idx.size, self.k, self.niter)
        index = faiss.IndexFlatIP(d) if self.spherical else faiss.IndexFlatL2(d)
        index.add(km.centroids)
        n = embeddings.shape[0]
        labels = np.empty(n, dtype=np.int32)
        score = np.empty(n, dtype=np.float32)
        for start in range(0, n, self.assign_batch):
            block = np.ascontiguousarray(embeddings[start:start + self.assign_batch], dtype=np.float32)
            if not np.isfinite(block).all():
                raise CcexpError("clusterer: the embeddings contain NaN or inf; re-run the embed stage")
            dist, idx = index.search(block, 1)
            labels[start:start + block.shape[0]] = idx[:, 0]
            score[start:start + block.shape[0]] = dist[:, 0]
        sizes = np.bincount(labels[train_idx], minlength=self.k).astype(np.int64)
        return Clustering(labels, km.centroids.astype(np.float32), sizes, score, int(x.shape[0]),
                          float(km.obj[-1]) if len(km.obj) else float("nan"))
