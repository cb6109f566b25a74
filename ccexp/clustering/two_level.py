"""Top-down two-level spherical k-means on FAISS: fast k-means for large K.

Flat k-means costs O(N · K · d) per Lloyd iteration; at N = 1M, K = 10,000, d = 384 that is ~47 s
per iteration on a 2-core CPU. The two-level scheme (FAISS's ``faiss.contrib.clustering.
two_level_clustering``; the coarse-quantizer idea of the inverted file, Jégou, Douze & Schmid,
"Product quantization for nearest neighbor search", TPAMI 2011, §IV) trains

1. ``K1`` coarse centroids (default ``round(sqrt(K))``) on a seeded sample, and assigns the
   training sample to them;
2. inside every coarse cell, ``k_c`` fine centroids by k-means on that cell's points alone, with
   ``k_c`` proportional to the cell's size (largest remainder; every non-empty cell gets at least
   one, none more than its points), ``sum k_c = K``.

Each iteration then costs O(N · (K1 + K/K1) · d) ≈ O(N · 2√K · d). Every document is assigned by an
inverted-file search: its ``nprobe`` nearest coarse cells are searched for the nearest fine
centroid (``nprobe = K1`` is the exact nearest centroid). Unlike FAISS's helper (which returns only the fine centroids, logs with
``print`` and can give a cell more centroids than points), this keeps the coarse level: it is
``levels[1]`` of the [`Clustering`][ccexp.clustering.kmeans.Clustering], each fine cluster's ``parent``
its cell, so samplers can balance at ``sampler.level=1``. It is a speed tool; for balanced
curation use [`ccexp.clustering.hierarchical`][ccexp.clustering.hierarchical] (Vo et al. 2024).
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ccexp.clustering.kmeans import (Clustering, Level, check_k, finite_blocks, train_centroids, training_sample,
                                    use_gpu)
from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


def coarse_cells(k: int, coarse_k: int | None) -> int:
    """K1, the coarse cells of a two-level clustering into ``k`` clusters: ``coarse_k``, or ``round(sqrt(k))``."""
    return max(1, round(k ** 0.5)) if coarse_k is None else int(coarse_k)


def allot(k: int, sizes: np.ndarray) -> np.ndarray:
    """Share ``k`` fine centroids among coarse cells in proportion to their sizes.

    Args:
        k: total fine centroids; at least the number of non-empty cells and at most ``sizes.sum()``.
        sizes: int[K1] points per coarse cell.

    Returns:
        int64[K1] centroids per cell: summing to ``k``, ``>= 1`` for a non-empty cell, ``<= sizes``
        (largest-remainder rounding of ``k · sizes / sizes.sum()``).

    Raises:
        CcexpError: if ``k`` is below the number of non-empty cells or above the points.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    nonempty = int((sizes > 0).sum())
    if not nonempty <= k <= int(sizes.sum()):
        raise CcexpError(f"clusterer: cannot share {k} fine centroids among {nonempty} non-empty coarse cells "
                         f"holding {int(sizes.sum())} points; lower clusterer.coarse_k or clusterer.k")
    quota = k * sizes / sizes.sum()
    alloc = np.minimum(np.where(sizes > 0, np.maximum(1, np.floor(quota)), 0), sizes).astype(np.int64)
    while (gap := k - int(alloc.sum())) != 0:
        if gap > 0:  # the largest remainders among cells with room get one more
            room = alloc < sizes
            key = np.where(room, quota - alloc, -np.inf)
        else:  # forced minimums overshot: the smallest remainders among cells above one give one back
            room = alloc > 1
            key = np.where(room, alloc - quota, -np.inf)
        take = np.argsort(-key, kind="stable")[:min(abs(gap), int(room.sum()))]
        alloc[take] += 1 if gap > 0 else -1
    return alloc


class TwoLevelKMeans:
    """See the module docstring.

    Args:
        k: fine clusters K (``1 <= K <=`` training documents).
        coarse_k: coarse cells K1; None = ``round(sqrt(K))``.
        niter: Lloyd iterations at each level.
        seed: FAISS seed and the sample's seed (cell c's fine k-means uses ``seed + 1 + c``).
        max_points_per_centroid: train the fine level on a seeded sample of at most ``K ·`` this many
            training documents, the coarse level on at most ``K1 ·`` this many of them.
        spherical: cosine k-means (normalised centroids).
        nprobe: coarse cells searched when assigning a document (``K1``: exact nearest centroid).
        assign_batch: vectors per assignment batch.
        device: ``auto`` (GPU when FAISS has one), ``cpu`` or ``gpu``.
        verbose: FAISS's per-iteration log.

    Raises:
        CcexpError: for ``coarse_k`` outside ``1..k`` or ``nprobe < 1``.
    """

    def __init__(self, k: int = 1024, coarse_k: int | None = None, niter: int = 20, seed: int = 0,
                 max_points_per_centroid: int = 256, spherical: bool = True, nprobe: int = 3,
                 assign_batch: int = 65536, device: str = "auto", verbose: bool = False):
        self.k, self.niter, self.seed = int(k), int(niter), int(seed)
        self.coarse_k = coarse_cells(self.k, coarse_k)
        if not 1 <= self.coarse_k <= self.k:
            raise CcexpError(f"clusterer.coarse_k={coarse_k} must be in 1..clusterer.k ({self.k}); or null for "
                             f"round(sqrt(k)) = {coarse_cells(self.k, None)}")
        if nprobe < 1:
            raise CcexpError(f"clusterer.nprobe={nprobe} must be >= 1 (coarse cells searched per document)")
        self.nprobe = min(int(nprobe), self.coarse_k)
        self.max_points_per_centroid, self.spherical = int(max_points_per_centroid), bool(spherical)
        self.assign_batch, self.device, self.verbose = int(assign_batch), device, bool(verbose)

    def fit(self, embeddings: np.ndarray, train_mask: np.ndarray) -> Clustering:
        """Train both levels on ``embeddings[train_mask]`` and assign every row.

        Args:
            embeddings: float[N, d] (float16 or float32; may be a memory map), L2-normalised.
            train_mask: bool[N], True for the documents that train the centroids and count in sizes.

        Returns:
            a two-level [`Clustering`][ccexp.clustering.kmeans.Clustering]: ``levels[0]`` the K fine clusters, ``levels[1]`` the K1
            coarse cells (``parent``: int32[K], each fine cluster's cell). Its ``objective`` is the sum
            over the training sample of the cosine similarity to the assigned fine centroid (FAISS's
            spherical objective; higher is better).

        Raises:
            CcexpError: if K exceeds the training documents, or an embedding is not finite.
        """
        train_idx = np.flatnonzero(train_mask)
        check_k(self.k, train_idx.size)
        gpu = use_gpu(self.device)
        sample = training_sample(train_idx, self.k * self.max_points_per_centroid, self.seed)
        x = np.ascontiguousarray(embeddings[sample], dtype=np.float32)
        if not np.isfinite(x).all():
            raise CcexpError("clusterer: the embeddings contain NaN or inf; re-run the embed stage")
        coarse_rows = training_sample(np.arange(x.shape[0]), self.coarse_k * self.max_points_per_centroid, self.seed)
        coarse, _ = train_centroids(x[coarse_rows], self.coarse_k, niter=self.niter, seed=self.seed,
                                    spherical=self.spherical, gpu=gpu, verbose=self.verbose)
        cell = _nearest(x, coarse, self.spherical)
        centroids, parent = self._fine(x, cell, gpu)
        labels, similarity, coarse_sim = _assign(embeddings, coarse, centroids, parent, nprobe=self.nprobe,
                                                 spherical=self.spherical, batch=self.assign_batch)
        objective = float(similarity[sample].sum(dtype=np.float64))
        log.info("cluster: two-level k-means trained on %d of %d training documents (K1=%d coarse cells, K=%d, "
                 "%d iterations, nprobe %d%s)", sample.size, train_idx.size, self.coarse_k, self.k, self.niter,
                 self.nprobe, ", GPU" if gpu else "")
        fine_sizes = np.bincount(labels[train_idx], minlength=self.k).astype(np.int64)
        coarse_labels = parent[labels]
        levels = [Level(labels, centroids, fine_sizes, similarity),
                  Level(coarse_labels, coarse, np.bincount(coarse_labels[train_idx], minlength=self.coarse_k)
                        .astype(np.int64), coarse_sim, parent)]
        return Clustering(levels, int(sample.size), objective)

    def _fine(self, x: np.ndarray, cell: np.ndarray, gpu: bool) -> tuple[np.ndarray, np.ndarray]:
        """Fine k-means inside every coarse cell, one cell after another (each seeded by its index):
        centroids float32[K, d] grouped by cell, and parent int32[K]."""
        sizes = np.bincount(cell, minlength=self.coarse_k)
        alloc = allot(self.k, sizes)
        order = np.argsort(cell, kind="stable")
        starts = np.concatenate([[0], np.cumsum(sizes)])
        pieces = []
        t0 = last = time.perf_counter()
        for c in np.flatnonzero(alloc):
            members = x[order[starts[c]:starts[c + 1]]]
            if alloc[c] == members.shape[0]:  # as many centroids as points: the points are the centroids
                pieces.append(members)
            else:
                pieces.append(train_centroids(members, int(alloc[c]), niter=self.niter, seed=self.seed + 1 + int(c),
                                              spherical=self.spherical, gpu=gpu, verbose=self.verbose,
                                              progress_every_s=None)[0])
            if (now := time.perf_counter()) - last >= 10.0:
                last, done = now, int(alloc[:c + 1].sum())
                log.info("cluster: fine k-means, %d/%d centroids in %d/%d cells, %.0f s, ETA %.0f s", done, self.k,
                         c + 1, self.coarse_k, now - t0, (now - t0) / done * (self.k - done))
        return np.concatenate(pieces).astype(np.float32), np.repeat(np.arange(self.coarse_k), alloc).astype(np.int32)


def _nearest(x: np.ndarray, centroids: np.ndarray, spherical: bool) -> np.ndarray:
    import faiss

    index = faiss.IndexFlatIP(x.shape[1]) if spherical else faiss.IndexFlatL2(x.shape[1])
    index.add(centroids)
    return index.search(x, 1)[1][:, 0]


def _assign(x: np.ndarray, coarse: np.ndarray, centroids: np.ndarray, parent: np.ndarray, *, nprobe: int,
            spherical: bool, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverted-file assignment of every row of ``x`` (float[N, d], streamed in ``batch`` rows): the
    nearest fine centroid among those of its ``nprobe`` nearest coarse cells (``centroids`` grouped by
    cell, ``parent`` int32[K] ascending). Each probed cell's rows are scored against its centroids in
    one matrix product, so a row costs ``K1 + nprobe · K/K1`` dot products instead of ``K``.

    Returns:
        labels int32[N], and the cosine similarity float32[N] of each row to its fine centroid and to
        that centroid's coarse cell.

    Raises:
        CcexpError: if a row is not finite.
    """
    k1 = coarse.shape[0]
    first = np.concatenate([[0], np.cumsum(np.bincount(parent, minlength=k1))])  # cell c: first[c]:first[c+1]
    sq_norms = (centroids * centroids).sum(1)
    # L2: argmin |x - c|^2 = argmax x.c - |c|^2 / 2; spherical: argmax x.c
    if spherical:
        half, coarse_half = 0.0, np.zeros(k1, np.float32)
    else:
        half, coarse_half = 0.5 * sq_norms, 0.5 * (coarse * coarse).sum(1)
    coarse_half = np.where(np.diff(first) > 0, coarse_half, np.inf)  # a cell without fine centroids is never probed
    norm, coarse_norm = np.sqrt(sq_norms), np.linalg.norm(coarse, axis=1)
    n = x.shape[0]
    labels = np.empty(n, dtype=np.int32)
    similarity = np.empty(n, dtype=np.float32)
    coarse_similarity = np.empty(n, dtype=np.float32)
    for start, block in finite_blocks(x, batch):
        coarse_dot, probe = _probe(block, coarse, coarse_half, nprobe)
        lab, dot = _best_in_cells(block, centroids, first, half, probe)
        size = np.sqrt(np.einsum("ij,ij->i", block, block))
        sl = slice(start, start + block.shape[0])
        labels[sl] = lab
        similarity[sl] = dot / np.maximum(size * norm[lab], 1e-12)
        hit = probe == parent[lab][:, None]  # the assigned centroid's cell is one of the probed cells
        coarse_similarity[sl] = coarse_dot[hit] / np.maximum(size * coarse_norm[parent[lab]], 1e-12)
    return labels, similarity, coarse_similarity


def _probe(block: np.ndarray, coarse: np.ndarray, half, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``nprobe`` nearest coarse cells of each row (by ``x.c - half[c]``; ``half[c] = inf`` for a cell
    that must not be probed; int64[b, nprobe]) and the row's inner product with each (float32[b, nprobe])."""
    dot = block @ coarse.T
    score = dot - half
    nprobe = min(nprobe, int(np.isfinite(half).sum()))
    if nprobe == 1:
        probe = np.argmax(score, axis=1)[:, None]
    else:
        probe = np.argpartition(-score, nprobe - 1, axis=1)[:, :nprobe]
    return np.take_along_axis(dot, probe, axis=1), probe


def _best_in_cells(block: np.ndarray, centroids: np.ndarray, first: np.ndarray, half, probe: np.ndarray):
    """For each row, the best fine centroid (by ``x.c - half[c]``) among its probed cells' centroids:
    labels int32[b] and the inner product x.c float32[b]."""
    b, nprobe = probe.shape
    cells = probe.ravel()
    rows = np.repeat(np.arange(b), nprobe)
    order = np.argsort(cells, kind="stable")
    bounds = np.searchsorted(cells[order], np.arange(first.size))
    best = np.full(b, -np.inf, dtype=np.float32)
    lab = np.zeros(b, dtype=np.int32)
    dot = np.zeros(b, dtype=np.float32)
    for c in np.flatnonzero(np.diff(bounds)):
        r = rows[order[bounds[c]:bounds[c + 1]]]
        d = block[r] @ centroids[first[c]:first[c + 1]].T
        s = d if np.isscalar(half) else d - half[first[c]:first[c + 1]]
        j = np.argmax(s, axis=1)
        v = s[np.arange(r.size), j]
        better = v > best[r]
        best[r[better]], lab[r[better]] = v[better], first[c] + j[better]
        dot[r[better]] = d[np.flatnonzero(better), j[better]]
    return lab, dot
