"""``unimax``: a uniform budget over clusters with a per-document repetition cap (Chung et al. 2023, "UniMax: Fairer and More Effective Language Sampling for Large-Scale
Multilingual Pretraining", ICLR, Algorithm 1).

Algorithm 1 in tokens: with a budget of ``D`` tokens (the run's ``steps · tokens_per_step``) and a cap
of ``E`` epochs, visit the clusters from the smallest (in tokens ``T_c``) to the largest and give each
``a_c = min(E · T_c, D_left / clusters_left)``, subtracting as it goes: small clusters get at most E
epochs and the rest of the budget is shared uniformly by the larger ones. Clusters are then drawn
i.i.d. (per block, keyed by ``(seed, block)``) with probability proportional to the documents each
allocation buys, ``a_c / mean document tokens of c``, so each cluster's *token* share is ``a_c / D``;
documents are passes over a permutation, and the cap is ClusterClip's quota (a cluster stops after
``E · n_c`` draws), so no document is drawn more than E times. Equals ``uniform``'s mix when every
cluster can absorb the uniform share; when ``D > E · T`` (the cap cannot hold the budget) the run is
refused at the start. State: exposure and block count — O(K).
"""
from __future__ import annotations

import numpy as np

from ccexp.errors import CcexpError
from ccexp.sampling.clip import RepetitionClip
from ccexp.sampling.uniform import UniformSampler

_UNIMAX_STREAM = 0x554E494D  # "UNIM"


def unimax_allocation(cluster_tokens: np.ndarray, budget: float, max_epochs: float) -> np.ndarray:
    """float64[K]: UniMax's allocation (Chung et al. 2023, Algorithm 1) of ``budget`` over clusters of
    ``cluster_tokens`` (float[K], 0 for empty clusters), at most ``max_epochs · T_c`` each."""
    t = np.asarray(cluster_tokens, dtype=np.float64)
    alloc = np.zeros_like(t)
    order = np.argsort(t, kind="stable")
    order = order[t[order] > 0]
    left = float(budget)
    # vectorised form of the sequential loop: cluster i (i-th smallest) is capped iff E·T_i is below
    # the uniform share of what the smaller ones left; the caps are a prefix of the sorted order
    capped_total = np.concatenate([[0.0], np.cumsum(max_epochs * t[order])])
    remaining = len(order) - np.arange(len(order))
    share = (left - capped_total[:-1]) / remaining
    capped = max_epochs * t[order] <= share
    first_uncapped = int(np.argmin(capped)) if not capped.all() else len(order)
    alloc[order[:first_uncapped]] = max_epochs * t[order[:first_uncapped]]
    if first_uncapped < len(order):
        alloc[order[first_uncapped:]] = share[first_uncapped]
    return alloc


class UniMaxSampler(UniformSampler):
    """UniMax over clusters; see the module docstring and [`Sampler`][ccexp.sampling.base.Sampler].

    Args:
        max_epochs: the cap E >= 1 (whole epochs: a document is drawn at most E times).
        on_exhausted: ``error`` (the default: the budget must fit under the cap) or ``reset``.

    Raises:
        CcexpError: for E < 1, or a token budget larger than the cap allows (``E ·`` all tokens).
    """

    name = "unimax"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None, max_epochs: int = 4,
                 on_exhausted: str = "error"):
        if max_epochs is None or int(max_epochs) < 1:
            raise CcexpError(f"sampler.max_epochs must be an integer >= 1, got {max_epochs}")
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget,
                         clip=RepetitionClip(np.asarray(sizes), int(max_epochs), on_exhausted, setting="sampler.max_epochs"))
        self.max_epochs = int(max_epochs)
        cluster_tokens = (self.sizes.astype(np.float64) if self.document_tokens is None  # one token per document
                          else np.bincount(self.labels, weights=self.document_tokens, minlength=self.num_clusters))
        budget = self.token_budget if self.token_budget is not None else float(cluster_tokens.sum())
        self.allocation = unimax_allocation(cluster_tokens, min(budget, self.max_epochs * cluster_tokens.sum()),
                                            self.max_epochs)
        mean_tokens = np.divide(cluster_tokens, self.sizes, out=np.ones(self.num_clusters), where=self.sizes > 0)
        w = self.allocation / mean_tokens
        self._pi = w / w.sum()

    def weights(self) -> np.ndarray:
        """float64[K]: the probability of drawing each cluster (the policy's fixed mix)."""
        return self._pi.copy()

    def _draw(self, lane: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _UNIMAX_STREAM, self._blocks])
        return self._iid_documents(rng, self._pi, self.block_size)
