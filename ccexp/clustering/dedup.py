"""Semantic deduplication inside clusters (SemDeDup, Abbas et al. 2023, arXiv 2303.09540, Sec. 3).

Near-duplicates share a k-means cluster, so each cluster is searched on its own: the cluster's
documents are ordered (``keep="hard"``, SemDeDup's default: farthest from the centroid first; ``easy``:
nearest first; ``random``), and a document is removed when its cosine similarity to an *earlier*
document of the order is at least ``threshold`` (SemDeDup's ``1 - ε``; to float32 precision, so 1.0
removes exactly the documents whose embeddings are identical). So from every group of
near-duplicates the first in the order survives, and a chain a~b~c removes b and c even if a and c
are further apart (as in SemDeDup, which compares with every earlier item, removed or not).

SemDeDup builds each cluster's full similarity matrix (O(n_c²) memory); here a FAISS range search
(``IndexFlatIP`` over the cluster, queries in batches of ``query_batch``) returns only the pairs above
the threshold, so memory is bounded by the cluster's vectors, one batch's results and the pairs found.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ccexp.errors import CcexpError

KEEP = ("hard", "easy", "random")
# cosine >= threshold is decided to float32 precision: identical unit rows give 1 - O(1e-7), so
# threshold=1.0 means exact (embedding-identical) copies, deterministically
_COSINE_SLACK = 1e-6


@dataclass
class Dedup:
    """The outcome over a corpus of N documents.

    Attributes:
        kept: bool[N]; False for a removed near-duplicate (documents outside the searched set: True).
        duplicate_of: int64[N]; for a removed document the earlier document it is closest to, else -1.
        similarity: float32[N]; that cosine similarity (NaN for kept documents).
    """

    kept: np.ndarray
    duplicate_of: np.ndarray
    similarity: np.ndarray

    @property
    def removed(self) -> np.ndarray:
        """int64[R]: the removed documents, ascending."""
        return np.flatnonzero(~self.kept)


def check_options(threshold: float, keep: str) -> None:
    """Raise `CcexpError` for a threshold outside (0, 1] or an unknown ``keep``."""
    if not 0.0 < float(threshold) <= 1.0:
        raise CcexpError(f"curate.dedup.threshold={threshold} must be a cosine similarity in (0, 1], e.g. 0.95")
    if keep not in KEEP:
        raise CcexpError(f"curate.dedup.keep={keep!r} is not an option; use {', '.join(KEEP)}")


def semantic_dedup(vectors: np.ndarray, labels: np.ndarray, threshold: float, *, mask: np.ndarray | None = None,
                   centroid_similarity: np.ndarray | None = None, keep: str = "hard", seed: int = 0,
                   query_batch: int = 4096) -> Dedup:
    """Remove near-duplicates within each cluster (module docstring).

    Args:
        vectors: float16/float32[N, d], L2-normalised embeddings (cosine = inner product).
        labels: int[N] cluster of each document.
        threshold: cosine similarity in (0, 1]; a pair at or above it is a near-duplicate.
        mask: bool[N], the documents searched (e.g. the training split); default all.
        centroid_similarity: float[N] cosine to the document's centroid (needed for ``hard``/``easy``).
        keep: which member of a group survives: ``hard`` (farthest from the centroid), ``easy``
            (nearest), ``random`` (seeded).
        seed: for ``keep="random"``; query_batch: queries per FAISS range search.

    Returns:
        [`Dedup`][ccexp.clustering.dedup.Dedup].

    Raises:
        CcexpError: for a threshold outside (0, 1], an unknown ``keep``, mismatched shapes, or
            non-finite vectors.
    """
    check_options(threshold, keep)
    n = vectors.shape[0]
    labels = np.asarray(labels)
    mask = np.ones(n, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    if labels.shape != (n,) or mask.shape != (n,):
        raise CcexpError(f"semantic_dedup: labels {labels.shape} and mask {mask.shape} must have the {n} rows of vectors")
    if keep != "random" and centroid_similarity is None:
        raise CcexpError(f"curate.dedup.keep={keep} needs each document's similarity to its centroid")
    order_key = _order_key(n, keep, seed, centroid_similarity)
    duplicate_of = np.full(n, -1, dtype=np.int64)
    best = np.full(n, np.nan, dtype=np.float32)
    for members in _cluster_members(labels, mask):  # one FAISS search per cluster
        if members.size < 2:
            continue
        members = members[np.lexsort((members, order_key[members]))]  # the keep order; ties by index
        _dedup_cluster(vectors, members, threshold, query_batch, duplicate_of, best)
    return Dedup(duplicate_of < 0, duplicate_of, best)


def _order_key(n: int, keep: str, seed: int, centroid_similarity: np.ndarray | None) -> np.ndarray:
    """float64[n]: the sort key of the keep order (smallest first) for ``keep``."""
    if keep == "random":
        return np.random.default_rng([seed, 0x44444550]).random(n)  # "DDEP"
    # hard: least similar to the centroid first
    return np.asarray(centroid_similarity, dtype=np.float64) * (1.0 if keep == "hard" else -1.0)


def _cluster_members(labels: np.ndarray, mask: np.ndarray) -> Iterator[np.ndarray]:
    """Yield the searched documents of each cluster (int64, ascending index), cluster by cluster."""
    searched = np.flatnonzero(mask)
    by_cluster = searched[np.argsort(labels[searched], kind="stable")]
    starts = np.flatnonzero(np.r_[True, np.diff(labels[by_cluster]) != 0])
    for begin, end in zip(starts, np.r_[starts[1:], by_cluster.size]):
        yield by_cluster[begin:end]


def _dedup_cluster(vectors: np.ndarray, members: np.ndarray, threshold: float, query_batch: int,
                   duplicate_of: np.ndarray, best: np.ndarray) -> None:
    """Write into ``duplicate_of``/``best`` each member's most similar earlier member at or above ``threshold``."""
    import faiss

    x = np.ascontiguousarray(vectors[members], dtype=np.float32)
    if not np.isfinite(x).all():
        raise CcexpError("semantic_dedup: the embeddings hold NaN or inf; recompute the embed stage")
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)  # float16 rows are unit only to ~1e-3
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    for q0 in range(0, members.size, query_batch):
        lims, sims, nbrs = index.range_search(x[q0:q0 + query_batch], float(threshold) - _COSINE_SLACK)
        queries = q0 + np.repeat(np.arange(lims.size - 1), np.diff(lims.astype(np.int64)))
        earlier = nbrs < queries  # positions in the keep order: only an earlier member removes one
        if not earlier.any():
            continue
        q, nb, s = queries[earlier], nbrs[earlier], sims[earlier]
        pick = np.lexsort((-s, q))  # per query, the most similar earlier member first
        first = pick[np.r_[True, np.diff(q[pick]) != 0]]
        duplicate_of[members[q[first]]] = members[nb[first]]
        best[members[q[first]]] = s[first]


def write_dedup_report(out_dir, result: Dedup, *, labels: np.ndarray, k: int, texts: list[str],
                       label_values: dict[str, list[str]], train_mask: np.ndarray, examples: int = 20,
                       snippet: int = 160) -> list:
    """Write the dedup report into ``out_dir``: ``dedup_clusters.csv`` (per cluster: training documents,
    removed, removed share), ``dedup_<label>.csv`` per label field (the same per label value) and
    ``dedup_examples.md`` (the ``examples`` removed documents with the highest similarity, each beside
    the document it duplicates, their first ``snippet`` characters). Returns the paths.

    Args:
        result: [`semantic_dedup`][ccexp.clustering.dedup.semantic_dedup]'s outcome; labels: int[N] clusters (of ``k``); texts: N documents;
        label_values: label field -> N values; train_mask: bool[N], the documents searched.
    """
    import csv
    from pathlib import Path

    from ccexp.names import markdown_cell

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    removed = ~result.kept
    paths = []
    groups = {"clusters": (np.arange(k).astype(str), np.asarray(labels))}
    for field, values in label_values.items():
        names, ids = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
        groups[field] = (names, ids)
    for group, (names, ids) in groups.items():
        docs = np.bincount(ids[train_mask], minlength=len(names))
        gone = np.bincount(ids[removed], minlength=len(names))
        path = out_dir / f"dedup_{group}.csv"
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["cluster" if group == "clusters" else group, "train_docs", "removed", "removed_share"])
            for g, name in enumerate(names):
                w.writerow([name, int(docs[g]), int(gone[g]), f"{gone[g] / docs[g]:.4f}" if docs[g] else ""])
        paths.append(path)
    order = result.removed[np.argsort(-result.similarity[result.removed], kind="stable")][:examples]

    lines = [f"# Semantic dedup: {int(removed.sum()):,} of {int(train_mask.sum()):,} training documents removed", "",
             f"The {len(order)} removed documents most similar to a kept one (cosine), beside it:", "",
             "| cosine | cluster | removed document | its nearest earlier document in the keep order (itself removed "
             "when it is a link of a chain) |", "|---:|---:|---|---|"]
    lines += [f"| {result.similarity[i]:.3f} | {int(labels[i])} | {markdown_cell(texts[i], snippet)} | "
              f"{markdown_cell(texts[result.duplicate_of[i]], snippet)} |" for i in order]
    md = out_dir / "dedup_examples.md"
    md.write_text("\n".join(lines) + "\n")
    return paths + [md]
