"""``cluster_dp``: CluSTER's balanced data-parallel allocation with loss re-weighting
(Kim et al., kaist-dmlab/CluSTER: ``custom_sampler.py``, ``coreset_trainer.py``; SAMPLING.md).

1. **Reduction**: every cluster keeps ``m = floor(min_c n_c · ratio)`` documents — the ``keep``
   farthest from the centroid (default, as the reference code), the closest, or a random subset.
2. **Allocation**: each global batch holds ``B / K`` documents of every cluster. With the
   ``blocked`` layout cluster c fills the c-th block of the batch, so when ``K`` equals the world
   size, rank r trains on cluster r (CluSTER's routing); ``interleaved`` puts position p on cluster
   ``p mod K``, spreading every cluster evenly over the ranks.
3. **Weighted update**: the loss of a document of cluster c is multiplied by
   ``w_c = K · n_c / N`` (original sizes), so the expected gradient matches the full-data mix;
   ``Σ_c w_c / K = 1``. :meth:`loss_weights` gives ``w``; the runner applies it per token.

Within a cluster, draws are passes over a pseudo-random permutation of its kept documents.
Invariants (tested): kept sizes are equal; every step covers every cluster equally; mean weight 1.
The gradient-proxy embedding and the size-capped clustering (K = world size) are upstream stages.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ccexp.errors import CcexpError
from ccexp.sampling.base import Sampler
from ccexp.sampling.permutation import affine_permute, derive_keys, pass_hash, shuffled_groups

_KEEP_STREAM = 0x4B454550  # "KEEP"
_DP_STREAM = 0x44505041  # "DPPA"


class ClusterDPSampler(Sampler):
    """CluSTER allocation; see the module docstring.

    Args:
        labels, sizes, global_batch_size, seed, total_steps: see :class:`ccexp.sampling.base.Sampler`.
        similarity: float[N] cosine similarity of each document to its centroid (needed for
            ``keep=farthest|closest``).
        ratio: fraction of the smallest cluster kept per cluster, in (0, 1].
        keep: ``farthest``, ``closest`` or ``random``.
        layout: ``blocked`` or ``interleaved``.

    Raises:
        CcexpError: if B is not a multiple of the number of non-empty clusters, or an option is invalid.
    """

    name = "cluster_dp"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, global_batch_size: int, seed: int = 0,
                 total_steps: int | None = None, similarity: np.ndarray | None = None, ratio: float = 1.0,
                 keep: str = "farthest", layout: str = "blocked"):
        super().__init__(labels, sizes, global_batch_size=global_batch_size, seed=seed, total_steps=total_steps)
        if keep not in ("farthest", "closest", "random"):
            raise CcexpError(f"sampler.keep={keep!r} is not an option; use farthest, closest or random")
        if layout not in ("blocked", "interleaved"):
            raise CcexpError(f"sampler.layout={layout!r} is not an option; use blocked or interleaved")
        if not 0.0 < ratio <= 1.0:
            raise CcexpError(f"sampler.ratio must be in (0, 1], got {ratio}")
        self._clusters = np.flatnonzero(self.sizes > 0)
        k = self._clusters.size
        if self.global_batch_size % k:
            raise CcexpError(f"cluster_dp needs train.global_batch_size ({self.global_batch_size}) to be a multiple of "
                             f"the {k} non-empty clusters; set it to {k * max(1, self.global_batch_size // k)}")
        self.per_cluster = self.global_batch_size // k
        self.kept_size = max(1, int(np.floor(self.sizes[self._clusters].min() * ratio)))
        self.keep, self.layout = keep, layout
        self._kept = self._reduce(similarity)  # int64[k, m]
        self._pass_key = derive_keys(self.seed, _DP_STREAM)

    def _reduce(self, similarity: np.ndarray | None) -> np.ndarray:
        if self.keep == "random":
            order = shuffled_groups(self.labels, np.random.default_rng([self.seed, _KEEP_STREAM]))
        else:
            if similarity is None or len(similarity) != self.num_documents:
                raise CcexpError(f"cluster_dp keep={self.keep} needs each document's similarity to its centroid; "
                                 "use keep=random without one")
            score = np.asarray(similarity, dtype=np.float64) * (1.0 if self.keep == "farthest" else -1.0)
            order = np.lexsort((score, self.labels))  # by cluster, then lowest score (= farthest) first
        starts = np.concatenate([[0], np.cumsum(self.sizes)])[self._clusters]
        return order[starts[:, None] + np.arange(self.kept_size)[None, :]]

    def kept_documents(self) -> np.ndarray:
        """int64[k, m]: the documents each non-empty cluster keeps (row j = cluster ``clusters[j]``)."""
        return self._kept.copy()

    def loss_weights(self) -> np.ndarray:
        """float64[K]: ``w_c = K · n_c / N`` (0 for empty clusters); mean over non-empty clusters is 1."""
        w = np.zeros(self.num_clusters)
        w[self._clusters] = self._clusters.size * self.sizes[self._clusters] / self.num_documents
        return w

    def _draw(self, step: int) -> np.ndarray:
        k, b = self._clusters.size, self.per_cluster
        row = np.repeat(np.arange(k), b)  # blocked: cluster j fills block j
        if self.layout == "interleaved":
            row = np.tile(np.arange(k), b)
        ordinal = self._exposure[self._clusters][row] + (np.arange(row.size) // k if self.layout == "interleaved"
                                                         else np.arange(row.size) % b)
        pass_idx, i = np.divmod(ordinal, self.kept_size)
        docs = self._kept[row, affine_permute(i, self.kept_size, pass_hash(self._pass_key, row, pass_idx))]
        self._exposure[self._clusters] += b
        return docs.astype(np.int64)

    def repetition_histogram(self) -> dict[int, int]:
        from ccexp.sampling.base import pass_histogram

        hist = pass_histogram(self._exposure[self._clusters], np.full(self._clusters.size, self.kept_size))
        hist[0] = hist.get(0, 0) + self.num_documents - self._clusters.size * self.kept_size  # trimmed away
        return dict(sorted(hist.items()))

    def max_repetition(self) -> int:
        return int(-(-int(self._exposure[self._clusters].max(initial=0)) // self.kept_size))

    def active_clusters(self) -> int:
        return int(self._clusters.size)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "kept_size": self.kept_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("kept_size", self.kept_size)) != self.kept_size:
            raise CcexpError("sampler state was saved with another cluster_dp reduction (ratio or clustering)")
        super().load_state_dict(state)
