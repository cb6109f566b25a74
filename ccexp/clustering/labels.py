"""``clusterer=labels``: the groups are the values of a metadata field the corpus already carries
(domain, language, source), not embedding clusters — so every sampler balances over them and every
report breaks results down by them, through the same path as k-means clusters.

Group ids follow the sorted distinct values (``names``); a group's centroid is the normalised mean
embedding of its training documents, so the similarity-based options (``cluster_dp keep=farthest``,
the cluster report's nearest documents) keep working.
"""
from __future__ import annotations

import logging

import numpy as np

from ccexp.clustering.kmeans import Clustering, Level, cosine_to
from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


def value_ids(values: list[str]) -> tuple[list[str], np.ndarray]:
    """The sorted distinct values of a label (as strings) and each document's index among them (int64[N])."""
    names, ids = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    return names.tolist(), ids.astype(np.int64)


class LabelGroups:
    """Group documents by the value of ``label_field``.

    Args:
        label_field: a field listed in ``data.label_fields``.

    Raises:
        CcexpError: (from [`fit`][ccexp.clustering.labels.LabelGroups.fit]) if the corpus lacks the field or it has one value only.
    """

    def __init__(self, label_field: str = "domain"):
        self.label_field = label_field
        self.names: list[str] = []

    def fit(self, embeddings: np.ndarray, train_mask: np.ndarray, *,
            label_values: dict[str, list[str]] | None = None) -> Clustering:
        """One level: int32[N] group ids, float32[K, d] centroids (normalised mean embedding of each
        group's training documents), int64[K] training sizes, float32[N] cosine similarity.

        Args:
            embeddings: float[N, d]; train_mask: bool[N]; label_values: the corpus's label columns.
        """
        values = (label_values or {}).get(self.label_field)
        if values is None:
            raise CcexpError(f"clusterer.label_field={self.label_field!r} is not a label of this corpus "
                             f"({sorted(label_values or {})}); add it to data.label_fields")
        self.names, ids = value_ids(values)
        labels = ids.astype(np.int32)
        k = len(self.names)
        if k < 2:
            raise CcexpError(f"clusterer=labels: {self.label_field!r} has one value only ({self.names[0]!r}); "
                             "there is nothing to balance")
        train = np.asarray(train_mask, dtype=bool)
        x = np.asarray(embeddings, dtype=np.float32)
        sums = np.zeros((k, x.shape[1]), dtype=np.float64)
        np.add.at(sums, labels[train], x[train])
        missing = ~np.isin(np.arange(k), labels[train])
        if missing.any():  # a value only among held-out documents: centre it on those
            np.add.at(sums, labels[~train], np.where(missing[labels[~train]][:, None], x[~train], 0.0))
        centroids = (sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)).astype(np.float32)
        sizes = np.bincount(labels[train], minlength=k).astype(np.int64)
        log.info("cluster: %d groups from label %r: %s", k, self.label_field,
                 ", ".join(f"{n} ({s:,})" for n, s in zip(self.names, sizes)))
        return Clustering([Level(labels, centroids, sizes, cosine_to(x, centroids, labels), names=list(self.names))],
                          int(train.sum()), float("nan"))
