"""``clusterclip``: ClusterClip sampling (Shao et al., "Balanced Data Sampling for Language Model
Training with Clustering", ACL Findings 2024, arXiv 2402.14526, §3 and Figure 1).

The algorithm (Shao et al., arXiv 2402.14526, the method section), one draw at a time:

1. **Balance the clusters**: pick a cluster uniformly among the clusters still active (``uniform``'s
   rounds: each round visits every active cluster once, in a fresh order).
2. **Pick a document**: the next document of that cluster's current pass over a permutation of its
   members, so repetition counts inside a cluster never differ by more than one.
3. **Clip**: a document drawn ``M = clip_threshold`` times leaves the pool. With passes, that is
   "the cluster finished M passes": cluster c takes at most ``M · n_c`` draws
   ([`RepetitionClip`][ccexp.sampling.clip.RepetitionClip], O(K) state), then leaves the active set for good.
4. **After a clip** (``after_clip``): ``uniform`` (default, the reading of Fig. 1) keeps picking
   uniformly among the clusters left; ``proportional`` picks i.i.d. with probability proportional to
   the documents each cluster has left.
5. **When every cluster is clipped** before the budget is spent (``on_exhausted``): ``error`` stops —
   checked up front against the run's token budget (``M`` times the corpus's tokens) — or ``reset``
   starts the repetition counts again.

Invariants (tested in ``tests/test_sampling_properties.py``): no document is drawn more than ``M``
times between resets; while every cluster is active frequencies are ``1/K`` (per round); a clipped
cluster never reappears; with ``M >= D`` the stream equals ``uniform``'s for the same seed; and the
Fig. 1 toy (A=5, B=1, C=3 documents, M=2) shows B exactly twice, in blocks 1 and 2 (blocks of 3 documents).
"""
from __future__ import annotations

import numpy as np

from ccexp.errors import CcexpError
from ccexp.sampling.clip import RepetitionClip
from ccexp.sampling.uniform import UniformSampler

_PROPORTIONAL_STREAM = 0x50524F50  # "PROP"


class ClusterClipSampler(UniformSampler):
    """Uniform cluster sampling with a per-document repetition clip.

    Args:
        labels: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        sizes: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        block_size: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        seed: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        document_tokens: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        token_budget: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler]; with ``on_exhausted="error"`` a budget
            above ``M · sum(document_tokens)`` is rejected here, before any training.
        clip_threshold: M >= 1, the most times a document may be drawn (between resets).
        after_clip: ``"uniform"`` or ``"proportional"`` (step 4 above).
        on_exhausted: ``"error"`` or ``"reset"`` (step 5 above).

    Raises:
        CcexpError: for an invalid option or a budget the clip cannot supply.
    """

    name = "clusterclip"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 clip_threshold: int = 5, after_clip: str = "uniform", on_exhausted: str = "error",
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None):
        if after_clip not in ("uniform", "proportional"):
            raise CcexpError(f"sampler.after_clip={after_clip!r} is not an option; use 'uniform' or 'proportional'")
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget, clip=RepetitionClip(sizes, clip_threshold, on_exhausted))
        self.after_clip = after_clip

    def _draw(self, lane: int) -> np.ndarray:
        if self.after_clip == "proportional" and self.clip.clipped_any(self._exposure):
            rng = np.random.default_rng([self.seed, _PROPORTIONAL_STREAM, self._blocks])
            weights = self.clip.documents_left(self._exposure).astype(np.float64)
            return self._iid_documents(rng, weights, self.block_size)  # steps 4-5 (proportional), then 2
        # steps 1, 3-5 (rounds over the active clusters), then 2: the next document of each cluster's pass
        return self._round_documents(self.block_size)
