"""The training and held-out documents of a run, at one clustering level ([`TrainSplit`][ccexp.data.split.TrainSplit])."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TrainSplit:
    """The documents a run trains and evaluates on, at one clustering level.

    Attributes:
        train_docs: int64[N_train] corpus indices of the training documents (a balanced selection's
            subset when one was made); heldout_docs: int64[N_heldout].
        labels: int32[N] cluster of every corpus document; similarity: float32[N] cosine similarity
            to its centroid; sizes: int64[K] training documents per cluster; names: the K clusters'
            names when the clustering has them (groups from a label), else None.
    """

    train_docs: np.ndarray
    heldout_docs: np.ndarray
    labels: np.ndarray
    similarity: np.ndarray
    sizes: np.ndarray
    names: list[str] | None = None

    @property
    def num_clusters(self) -> int:
        return int(self.sizes.size)
