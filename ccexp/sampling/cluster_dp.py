"""``cluster_dp``: CluSTER's balanced data-parallel allocation with loss re-weighting
(Kim et al., kaist-dmlab/CluSTER: ``custom_sampler.py``, ``coreset_trainer.py``).

1. **Reduction**: every cluster keeps ``m = floor(min_c n_c · ratio)`` documents — the ``keep``
   farthest from the centroid (default, as the reference code), the closest, or a random subset.
2. **Allocation**: every cluster is its own *lane* — an independent document stream packed into
   its own rows — and each optimizer step gives every cluster ``R / K`` of its ``R`` rows, i.e.
   exactly the same number of tokens. With the ``blocked`` layout cluster c fills the c-th block of
   rows, so when ``K`` equals the world size, rank r trains on cluster r (CluSTER's routing);
   ``interleaved`` gives row p to cluster ``p mod K``, spreading every cluster evenly over the ranks.
3. **Weighted update**: the loss of a document of cluster c is multiplied by
   ``w_c = K · n_c / N`` (original sizes), so the expected gradient matches the full-data mix;
   ``Σ_c w_c / K = 1``. `loss_weights` gives ``w``; the runner applies it per token.

Within a cluster, draws are passes over a pseudo-random permutation of its kept documents.
Invariants (tested): kept sizes are equal; every step gives every cluster the same number of
tokens; mean weight 1.
The gradient-proxy embedding and the size-capped clustering (K = world size) are upstream stages.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

import ccexp.sampling.kernels as kernels
from ccexp.errors import CcexpError
from ccexp.sampling.base import Sampler
from ccexp.sampling.permutation import derive_keys

_KEEP_STREAM = 0x4B454550  # "KEEP"
_DP_STREAM = 0x44505041  # "DPPA"


class ClusterDPSampler(Sampler):
    """CluSTER allocation; see the module docstring.

    Args:
        labels: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        sizes: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        seed: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        document_tokens: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        token_budget: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        block_size: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler]; here per lane, i.e. per cluster.
        similarity: float[N] cosine similarity of each document to its centroid (needed for
            ``keep=farthest|closest``).
        ratio: fraction of the smallest cluster kept per cluster, in (0, 1].
        keep: ``farthest``, ``closest`` or ``random``.
        layout: ``blocked`` or ``interleaved``.

    Raises:
        CcexpError: if an option is invalid, or (from [`row_lanes`][ccexp.sampling.cluster_dp.ClusterDPSampler.row_lanes]) a step's rows are not a
            multiple of the number of non-empty clusters.
    """

    name = "cluster_dp"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None,
                 similarity: np.ndarray | None = None, ratio: float = 1.0, keep: str = "farthest",
                 layout: str = "blocked"):
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget)
        if keep not in ("farthest", "closest", "random"):
            raise CcexpError(f"sampler.keep={keep!r} is not an option; use farthest, closest or random")
        if layout not in ("blocked", "interleaved"):
            raise CcexpError(f"sampler.layout={layout!r} is not an option; use blocked or interleaved")
        if not 0.0 < ratio <= 1.0:
            raise CcexpError(f"sampler.ratio must be in (0, 1], got {ratio}")
        self._clusters = np.flatnonzero(self.sizes > 0)
        self.num_lanes = int(self._clusters.size)  # lane j = cluster self._clusters[j]
        # floor(m · ratio) with the ratio as written (a decimal): 100 x 0.29 is 29, where floats give 28.999...
        from fractions import Fraction

        self.kept_size = max(1, int(int(self.sizes[self._clusters].min()) * Fraction(repr(float(ratio)))))
        self.keep, self.layout = keep, layout
        self._kept = self._reduce(similarity)  # int[k, m]
        self._pass_key = np.uint64(derive_keys(self.seed, _DP_STREAM))

    def notes(self) -> list[tuple[int, str]]:
        """The reduction's size, and a warning when one cluster leaves CluSTER nothing to balance."""
        kept = self.kept_size * self.num_lanes
        out = [(logging.INFO, f"cluster_dp: every cluster keeps {self.kept_size:,} documents ({kept:,} of "
                              f"{self.labels.size:,} training documents, keep={self.keep})")]
        if self.num_lanes == 1:
            out.append((logging.WARNING, f"cluster_dp: one cluster (K = {self.sizes.size}), so CluSTER balances "
                        "nothing; K defaults to the world size (+recipe=cluster_sft): set clusterer.k or use more devices"))
        return out

    def _reduce(self, similarity: np.ndarray | None) -> np.ndarray:
        if self.keep == "random":
            order = kernels.shuffled_groups(self.labels, self.sizes, np.random.default_rng([self.seed, _KEEP_STREAM]))
        else:
            if similarity is None or len(similarity) != self.num_documents:
                raise CcexpError(f"cluster_dp keep={self.keep} needs each document's similarity to its centroid; "
                                 "use keep=random without one")
            score = np.asarray(similarity, dtype=np.float64) * (1.0 if self.keep == "farthest" else -1.0)
            # by cluster, then lowest score (= farthest) first, then index: np.lexsort((score, labels)),
            # as a stable sort by score and a stable counting sort by cluster
            order = kernels.group_stable(np.argsort(score, kind="stable"), self.labels, self.sizes)
        starts = np.concatenate([[0], np.cumsum(self.sizes)])[self._clusters]
        kept = np.empty((self._clusters.size, self.kept_size), order.dtype)
        for row, start in enumerate(starts):
            kept[row] = order[start:start + self.kept_size]
        return kept

    def kept_documents(self) -> np.ndarray:
        """int64[k, m]: the documents each non-empty cluster keeps (row j = cluster ``clusters[j]``)."""
        return self._kept.copy()

    def loss_weights(self) -> np.ndarray:
        """float64[K]: ``w_c = K · n_c / N`` (0 for empty clusters); mean over non-empty clusters is 1."""
        w = np.zeros(self.num_clusters)
        w[self._clusters] = self._clusters.size * self.sizes[self._clusters] / self.num_documents
        return w

    def row_lanes(self, rows: int) -> np.ndarray:
        """Lane (= non-empty cluster) of each of a step's ``rows`` rows: ``blocked`` gives cluster j the
        j-th block of ``rows / K`` rows, ``interleaved`` gives row p to cluster ``p mod K``.

        Raises:
            CcexpError: if ``rows`` is not a multiple of the K non-empty clusters.
        """
        k = self.num_lanes
        if rows % k:
            raise CcexpError(f"cluster_dp gives every cluster the same rows of each step, so the step's "
                             f"{rows} rows (train.tokens_per_step / train.seq_len) must be a multiple of the "
                             f"{k} non-empty clusters; set train.tokens_per_step to a multiple of {k} x train.seq_len")
        lanes = np.arange(k, dtype=np.int64)
        return np.repeat(lanes, rows // k) if self.layout == "blocked" else np.tile(lanes, rows // k)

    def _draw(self, lane: int) -> np.ndarray:
        """The next ``block_size`` kept documents of cluster ``clusters[lane]``: passes over a permutation."""
        c = self._clusters[lane]
        docs = np.empty(self.block_size, np.int64)
        kernels.pass_block(self._kept[lane], 0, self.kept_size, lane, self._pass_key, self._exposure[c],
                           self.block_size, docs, 0)
        self._exposure[c] += self.block_size
        return docs

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
