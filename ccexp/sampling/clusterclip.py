"""``clusterclip``: ClusterClip sampling (Shao et al., "Balanced Data Sampling for Language Model
Training with Clustering", ACL Findings 2024, arXiv 2402.14526, §3 and Figure 1).

Algorithm (SAMPLING.md, "clusterclip"):

1. Sample clusters uniformly and documents uniformly within a cluster (:class:`UniformSampler`).
2. **Repetition clip**: a document drawn ``M = clip_threshold`` times leaves the pool. Draws inside
   a cluster are passes over a permutation, so "every document of cluster c was drawn M times" is
   "cluster c finished M passes": cluster c may take ``M · n_c`` draws in all, and the state stays
   O(K) (exposure counters), not a per-document counter.
3. A cluster whose documents have all left is never drawn again. What remains is sampled
   ``after_clip``:

   * ``uniform`` (default, the reading of Fig. 1): uniformly over the clusters still active;
   * ``proportional``: once the first cluster is clipped, i.i.d. over clusters with probability
     proportional to the documents each has left.

4. If every cluster is exhausted before the budget is spent: ``on_exhausted=error`` stops with a
   message giving the largest possible budget — ``M · N`` documents, ``M · T`` tokens for the
   ``T`` tokens of the corpus — checked up front when the run's token budget is known; ``reset``
   sets the repetition counts back to zero and starts again.

Invariants (tested in ``tests/test_sampling_properties.py``): no document is drawn more than ``M``
times between resets; while every cluster is active frequencies are ``1/K`` (per round); a clipped
cluster never reappears; with ``M >= D`` the stream equals ``uniform``'s for the same seed; and the
Fig. 1 toy (A=5, B=1, C=3 documents, M=2) shows B exactly twice, in blocks 1 and 2 (blocks of 3 documents).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ccexp.errors import CcexpError
from ccexp.sampling.uniform import UniformSampler

_PROPORTIONAL_STREAM = 0x50524F50  # "PROP"


class ClusterClipSampler(UniformSampler):
    """Uniform cluster sampling with a per-document repetition clip.

    Args:
        labels, sizes, block_size, seed: see :class:`ccexp.sampling.base.Sampler`.
        clip_threshold: M >= 1, the most times a document may be drawn (between resets).
        after_clip: ``"uniform"`` or ``"proportional"`` (see the module docstring).
        on_exhausted: ``"error"`` or ``"reset"``.
        document_tokens, token_budget: see :class:`~ccexp.sampling.base.Sampler`; when both are
            given and ``on_exhausted="error"``, a budget above ``M · sum(document_tokens)`` tokens is
            rejected here, before any training.

    Raises:
        CcexpError: for an invalid option or a budget the clip cannot supply.
    """

    name = "clusterclip"
    clip_optional = False

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 clip_threshold: int | None = 5, after_clip: str = "uniform", on_exhausted: str = "error",
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None):
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget)
        if clip_threshold is None and self.clip_optional:
            clip_threshold = 0  # 0 = no clip (only policies that build on this one allow it)
        elif clip_threshold is None or int(clip_threshold) < 1:
            raise CcexpError(f"sampler.clip_threshold must be an integer >= 1, got {clip_threshold}")
        if after_clip not in ("uniform", "proportional"):
            raise CcexpError(f"sampler.after_clip={after_clip!r} is not an option; use 'uniform' or 'proportional'")
        if on_exhausted not in ("error", "reset"):
            raise CcexpError(f"sampler.on_exhausted={on_exhausted!r} is not an option; use 'error' or 'reset'")
        self.clip_threshold = int(clip_threshold)
        self.after_clip = after_clip
        self.on_exhausted = on_exhausted
        self._resets = 0
        if (self.clip_threshold and on_exhausted == "error" and self.token_budget is not None
                and self.document_tokens is not None and self.token_budget > self.max_tokens):
            raise CcexpError(self._exhausted_message(self.token_budget))

    @property
    def max_draws(self) -> int:
        """The most documents the clip allows between resets: ``M · N``."""
        return self.clip_threshold * self.num_documents

    @property
    def max_tokens(self) -> int | None:
        """The most tokens the clip allows between resets, ``M · sum(document_tokens)`` (None if unknown)."""
        return None if self.document_tokens is None else self.clip_threshold * int(self.document_tokens.sum())

    def _exhausted_message(self, budget: int | None = None) -> str:
        supply = f"{self.max_draws:,} document draws"
        if self.max_tokens is not None:
            supply += f" = {self.max_tokens:,} tokens"
        need = f"the run needs {budget:,} tokens; " if budget else "every cluster is exhausted; "
        return (f"sampler.clip_threshold={self.clip_threshold} allows at most {supply} from {self.num_documents:,} "
                f"documents; {need}raise sampler.clip_threshold, lower train.steps or train.tokens_per_step, "
                f"or set sampler.on_exhausted=reset")

    def _limit(self) -> np.ndarray:
        return (self._resets + 1) * self.clip_threshold * self.sizes

    def _quota(self, exposure: np.ndarray) -> np.ndarray | None:
        return self._limit() - exposure if self.clip_threshold else None

    def _on_no_active_cluster(self) -> None:
        if self.on_exhausted == "error":
            raise CcexpError(self._exhausted_message())
        self._resets += 1

    def _stops_when_exhausted(self) -> bool:
        return bool(self.clip_threshold) and self.on_exhausted == "error"

    def active_clusters(self) -> int:
        quota = self._quota(self._exposure)
        return super().active_clusters() if quota is None else int(np.count_nonzero(quota > 0))

    def documents_left(self) -> np.ndarray:
        """int64[K]: documents of each cluster not yet drawn M times (since the last reset)."""
        drawn = self._exposure - self._resets * self.clip_threshold * self.sizes
        clipped = np.clip(drawn - (self.clip_threshold - 1) * self.sizes, 0, self.sizes)
        return self.sizes - clipped

    def _draw(self, lane: int) -> np.ndarray:
        clipped_any = self.clip_threshold and bool(np.any((self._quota(self._exposure) == 0) & (self.sizes > 0)))
        if self.after_clip == "uniform" or not clipped_any:
            return super()._draw(lane)
        rng = np.random.default_rng([self.seed, _PROPORTIONAL_STREAM, self._blocks])
        # clusters clipped during this block drop out through their quota inside _iid_clusters
        return self._documents(*self._iid_clusters(rng, self.documents_left().astype(np.float64), self.block_size))

    def max_repetition(self) -> int:
        if not self.clip_threshold:
            return super().max_repetition()
        drawn = self._exposure - self._resets * self.clip_threshold * self.sizes
        nz = self.sizes > 0
        return int((-(-np.maximum(drawn[nz], 0) // self.sizes[nz])).max(initial=0))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "resets": self._resets, "clip_threshold": self.clip_threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("clip_threshold", self.clip_threshold)) != self.clip_threshold:
            raise CcexpError(f"sampler state was saved with clip_threshold={state['clip_threshold']}, "
                             f"this run has {self.clip_threshold}")
        super().load_state_dict(state)
        self._resets = int(state["resets"])
