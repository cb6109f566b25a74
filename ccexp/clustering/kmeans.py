"""Flat spherical k-means on FAISS (the clustering step of ClusterClip, Shao et al. 2024, §3.1).

Centroids are trained on the training documents' embeddings (L2-normalised, so inner product =
cosine similarity; ``spherical=True`` re-normalises centroids each iteration, as the ClusterClip
repository's ``kmeans.py`` does). FAISS silently subsamples to ``k · max_points_per_centroid``
points; ccexp draws that sample itself, with the run's seed, and logs its size. Every document —
training and held-out — is then assigned to its nearest centroid in streamed batches over the
memory-mapped embeddings (float16 or float32 on disk), on the GPU when FAISS has one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


@dataclass
class Level:
    """One level of a clustering.

    Attributes:
        labels: int32[N] cluster of every document (training and held-out).
        centroids: float32[K, d].
        sizes: int64[K] training documents per cluster.
        similarity: float32[N] cosine similarity of each document to its cluster's centroid — higher
            is closer, whatever metric the k-means used.
        parent: int32[K_finer] cluster of this level that each cluster of the next finer level
            belongs to (None for the finest level).
        names: the K clusters' names when they have any (groups from a label: its values), else None.
    """

    labels: np.ndarray
    centroids: np.ndarray
    sizes: np.ndarray
    similarity: np.ndarray
    parent: np.ndarray | None = None
    names: list[str] | None = None

    @property
    def k(self) -> int:
        return int(self.sizes.size)


@dataclass
class Clustering:
    """A flat or hierarchical clustering: ``levels[0]`` is the finest level, each later one coarser
    (its ``parent`` maps the previous level's clusters to its own); ``train_points`` trained the
    finest centroids, reaching ``objective``."""

    levels: list[Level]
    train_points: int
    objective: float

    @property
    def labels(self) -> np.ndarray:
        """int32[N]: the finest level's labels (likewise ``centroids``, ``sizes``, ``similarity``)."""
        return self.levels[0].labels

    @property
    def centroids(self) -> np.ndarray:
        return self.levels[0].centroids

    @property
    def sizes(self) -> np.ndarray:
        return self.levels[0].sizes

    @property
    def similarity(self) -> np.ndarray:
        return self.levels[0].similarity

    def level(self, level: int) -> Level:
        """The clustering at ``level`` (0 = finest).

        Raises:
            CcexpError: if there is no such level.
        """
        check_level(level, [lv.k for lv in self.levels])
        return self.levels[level]


def use_gpu(device: str) -> bool:
    """``auto``: a GPU when this FAISS build has one; ``cpu``/``gpu`` force it (``gpu`` raises without one)."""
    import faiss

    n = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if device == "gpu" and n == 0:
        raise CcexpError("clusterer.device=gpu but this FAISS has no GPU (install faiss-gpu on a GPU machine); "
                         "use clusterer.device=auto")
    return device != "cpu" and n > 0


def train_centroids(x: np.ndarray, k: int, *, niter: int, seed: int, spherical: bool = True, nredo: int = 1,
                    gpu: bool = False, verbose: bool = False,
                    progress_every_s: float | None = 10.0) -> tuple[np.ndarray, float]:
    """FAISS k-means on all rows of ``x`` (float32[n, d], n >= k); returns centroids float32[k, d] and the
    final objective. Lloyd iterations run in chunks, each continuing from the last centroids, so a
    long clustering logs a progress line (iteration, objective, ETA) at least every
    ``progress_every_s`` seconds; None runs them in one call, silently (small problems).

    Raises:
        CcexpError: if ``x`` holds NaN or inf.
    """
    import time

    import faiss

    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise CcexpError("clusterer: the embeddings contain NaN or inf; re-run the embed stage")
    chunk = niter if progress_every_s is None else max(1, niter // 10)
    centroids, objective, done = None, float("nan"), 0
    t0 = last = time.perf_counter()
    while done < niter:
        step = min(chunk, niter - done)
        km = faiss.Kmeans(x.shape[1], k, niter=step, seed=seed + done, spherical=spherical,
                          nredo=nredo if centroids is None else 1, gpu=gpu, verbose=verbose,
                          max_points_per_centroid=max(256, -(-x.shape[0] // k)), min_points_per_centroid=1)
        km.train(x, init_centroids=centroids)
        centroids, done = km.centroids.copy(), done + step
        objective = float(km.obj[-1]) if len(km.obj) else objective
        now = time.perf_counter()
        if progress_every_s is not None and now - last >= progress_every_s and done < niter:
            last = now
            log.info("cluster: k-means iteration %d/%d, objective %.5g, %.0f s, ETA %.0f s", done, niter, objective,
                     now - t0, (now - t0) / done * (niter - done))
    return centroids.astype(np.float32), objective


def cosine_to(block: np.ndarray, centroids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """float32[n]: cosine similarity of each row of ``block`` (float[n, d]) to ``centroids[labels]``."""
    c = centroids[labels]
    dots = np.einsum("ij,ij->i", block, c)
    norms = np.linalg.norm(block, axis=1) * np.linalg.norm(c, axis=1)
    return (dots / np.maximum(norms, 1e-12)).astype(np.float32)


def finite_blocks(x: np.ndarray, batch: int):
    """Yield ``(start, block)``: the rows of ``x`` (float[n, d], any float dtype, may be a memory map) in
    float32 blocks of ``batch`` rows.

    Raises:
        CcexpError: if a row is not finite.
    """
    for start in range(0, x.shape[0], batch):
        block = np.ascontiguousarray(x[start:start + batch], dtype=np.float32)
        if not np.isfinite(block).all():
            raise CcexpError("clusterer: the embeddings contain NaN or inf; re-run the embed stage")
        yield start, block


def assign(x: np.ndarray, centroids: np.ndarray, *, spherical: bool = True, batch: int = 65536,
           gpu: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Nearest centroid of every row of ``x`` (streamed in ``batch`` rows, any float dtype, may be a
    memory map) by inner product (``spherical``) or L2 distance.

    Returns:
        labels int32[n] and similarity float32[n]: the cosine similarity to the assigned centroid,
        higher = closer for either metric (for unit-norm rows the order inside a cluster is the L2 order).

    Raises:
        CcexpError: if a row is not finite.
    """
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1]) if spherical else faiss.IndexFlatL2(centroids.shape[1])
    if gpu:
        index = faiss.index_cpu_to_all_gpus(index)
    index.add(np.ascontiguousarray(centroids, dtype=np.float32))
    n = x.shape[0]
    labels = np.empty(n, dtype=np.int32)
    score = np.empty(n, dtype=np.float32)
    for start, block in finite_blocks(x, batch):
        _, idx = index.search(block, 1)
        labels[start:start + block.shape[0]] = idx[:, 0]
        score[start:start + block.shape[0]] = cosine_to(block, centroids, idx[:, 0])
    return labels, score


def capped_assign(x: np.ndarray, centroids: np.ndarray, cap: int, *, spherical: bool = True) -> np.ndarray:
    """Assign every row of ``x`` (float32[n, d]) to a centroid (float32[K, d]) so that no cluster gets more
    than ``cap`` rows, each row as near as the caps allow: in rounds, every unassigned row proposes to
    its nearest centroid not yet refused, and each centroid accepts its nearest proposers while it has
    room (deferred acceptance, vectorised; at most K rounds). Needs ``K · cap >= n``.

    Returns:
        int32[n] labels.

    Raises:
        CcexpError: if the caps cannot hold every row, or the [n, K] score matrix would exceed 2^28 entries.
    """
    n, k = x.shape[0], centroids.shape[0]
    if k * cap < n:
        raise CcexpError(f"clusterer: a size cap of {cap} x {k} clusters cannot hold {n} documents; raise "
                         "clusterer.size_cap_epsilon")
    if n * k > 2**28:
        raise CcexpError(f"clusterer.size_cap_epsilon is meant for few clusters (K = world size); {n} x {k} scores "
                         "is too many: set it to null")
    # Euclidean: -|x - c|^2 = 2 x.c - |c|^2 - |x|^2, one matrix product (no [n, K, d] temporary)
    score = x @ centroids.T if spherical else \
        2 * (x @ centroids.T) - (centroids * centroids).sum(1)[None, :] - (x * x).sum(1)[:, None]
    labels = np.full(n, -1, dtype=np.int32)
    room = np.full(k, cap, dtype=np.int64)
    while (todo := np.flatnonzero(labels < 0)).size:
        choice = np.argmax(score[todo], axis=1)
        best = score[todo, choice]
        order = np.lexsort((-best, choice))  # by centroid, nearest proposer first
        ch = choice[order]
        first = np.searchsorted(ch, ch, side="left")
        accepted = (np.arange(ch.size) - first) < room[ch]
        labels[todo[order[accepted]]] = ch[accepted]
        room -= np.bincount(ch[accepted], minlength=k)
        score[todo[order[~accepted]], ch[~accepted]] = -np.inf  # refused: propose elsewhere next round
    return labels


def training_sample(train_idx: np.ndarray, size: int, seed: int) -> np.ndarray:
    """A seeded sample (sorted indices) of at most ``size`` training documents."""
    if train_idx.size <= size:
        return train_idx
    return np.sort(np.random.default_rng(seed).choice(train_idx, size, replace=False))


def check_level(level: int, counts: list[int], source: str = "the clustering") -> None:
    """Raises CcexpError unless ``level`` indexes ``counts`` (clusters per level, finest first, of ``source``)."""
    if not 0 <= level < len(counts):
        raise CcexpError(f"sampler.level={level} but {source} has {len(counts)} level(s) {list(counts)}; "
                         f"use a level in 0..{len(counts) - 1}")


def check_k(k: int, train_docs: int, key: str = "clusterer.k") -> None:
    if k < 1:
        raise CcexpError(f"{key} must be >= 1, got {k}")
    if k > train_docs:
        raise CcexpError(f"{key} asks for {k} clusters but the corpus has {train_docs:,} training documents; use at "
                         f"most {train_docs:,} clusters (or a larger corpus)")


class FaissKMeans:
    """Spherical k-means with FAISS.

    Args:
        k: number of clusters K (``1 <= K <=`` training documents).
        niter: Lloyd iterations.
        seed: FAISS seed, also used to draw the training sample.
        max_points_per_centroid: train on a seeded sample of at most ``K ·`` this many points.
        spherical: normalise centroids (cosine k-means).
        nredo: restarts; the best objective is kept.
        assign_batch: vectors per assignment batch.
        device: ``auto`` (GPU when FAISS has one), ``cpu`` or ``gpu``.
        verbose: FAISS's per-iteration log.
        size_cap_epsilon: CluSTER's size cap (kaist-dmlab/CluSTER, its step 2): no cluster holds more than
            ``ceil((1 + ε) · N_train / K)`` training documents — documents of a full cluster go to their
            next-nearest centroid with room ([`capped_assign`][ccexp.clustering.kmeans.capped_assign]); None = plain nearest-centroid.

    Raises:
        CcexpError: for ``size_cap_epsilon < 0``.
    """

    def __init__(self, k: int = 32, niter: int = 20, seed: int = 0, max_points_per_centroid: int = 256,
                 spherical: bool = True, nredo: int = 1, assign_batch: int = 65536, device: str = "auto",
                 verbose: bool = False, size_cap_epsilon: float | None = None):
        if size_cap_epsilon is not None and not size_cap_epsilon >= 0:
            raise CcexpError(f"clusterer.size_cap_epsilon={size_cap_epsilon} must be >= 0 (or null for no cap)")
        self.size_cap_epsilon = size_cap_epsilon
        self.k, self.niter, self.seed = int(k), int(niter), int(seed)
        self.max_points_per_centroid = int(max_points_per_centroid)
        self.spherical, self.nredo = bool(spherical), int(nredo)
        self.assign_batch, self.device, self.verbose = int(assign_batch), device, bool(verbose)

    def fit(self, embeddings: np.ndarray, train_mask: np.ndarray) -> Clustering:
        """Train centroids on ``embeddings[train_mask]`` and assign every row.

        Args:
            embeddings: float[N, d] (float16 or float32; may be a memory map).
            train_mask: bool[N], True for the documents that train the centroids and count in sizes.

        Raises:
            CcexpError: if K exceeds the training documents, K < 1, or an embedding is not finite.
        """
        train_idx = np.flatnonzero(train_mask)
        check_k(self.k, train_idx.size)
        gpu = use_gpu(self.device)
        sample = training_sample(train_idx, self.k * self.max_points_per_centroid, self.seed)
        centroids, objective = train_centroids(embeddings[sample], self.k, niter=self.niter, seed=self.seed,
                                               spherical=self.spherical, nredo=self.nredo, gpu=gpu,
                                               verbose=self.verbose)
        log.info("cluster: k-means trained on %d of %d training documents (K=%d, %d iterations%s)",
                 sample.size, train_idx.size, self.k, self.niter, ", GPU" if gpu else "")
        labels, similarity = assign(embeddings, centroids, spherical=self.spherical, batch=self.assign_batch, gpu=gpu)
        if self.size_cap_epsilon is not None:
            cap = int(np.ceil((1 + self.size_cap_epsilon) * train_idx.size / self.k))
            x = np.asarray(embeddings[train_idx], dtype=np.float32)
            capped = capped_assign(x, centroids, cap, spherical=self.spherical)
            log.info("cluster: size cap %d (epsilon %.2f): %d of %d training documents moved to a cluster with room",
                     cap, self.size_cap_epsilon, int((capped != labels[train_idx]).sum()), train_idx.size)
            labels[train_idx] = capped
            similarity[train_idx] = cosine_to(x, centroids, capped)
        sizes = np.bincount(labels[train_idx], minlength=self.k).astype(np.int64)
        return Clustering([Level(labels, centroids, sizes, similarity)], int(sample.size), objective)
