"""``temperature``: temperature sampling over clusters, the in-between of ``random`` and ``uniform``
(as for languages in multilingual LMs: Conneau & Lample 2019, XLM §3.1,
``q_i ∝ p_i^α``; Arivazhagan et al. 2019, "Massively Multilingual NMT", §4.2, ``T = 1/α``).

The cluster of each draw is i.i.d. from ``π_c ∝ n_c^α`` (α ∈ [0, 1]; α = 1 is random's cluster mix,
α = 0 is uniform's), drawn per block from a generator keyed by ``(seed, block)`` so the stream is a
deterministic function of the seed and the blocks drawn (it depends on the block size); the
document is the next of the cluster's passes over a permutation, as in ``uniform``. State: the
exposure counters and the block count — O(K).
"""
from __future__ import annotations

import numpy as np

from ccexp.errors import CcexpError
from ccexp.sampling.uniform import UniformSampler

_TEMPERATURE_STREAM = 0x54454D50  # "TEMP"


def temperature_weights(sizes: np.ndarray, alpha: float) -> np.ndarray:
    """float64[K] ``π_c = n_c^α / Σ_c' n_c'^α`` over the non-empty clusters (0 for empty ones)."""
    sizes = np.asarray(sizes, dtype=np.float64)
    w = np.where(sizes > 0, np.power(sizes, alpha, where=sizes > 0, out=np.zeros_like(sizes)), 0.0)
    return w / w.sum()


class TemperatureSampler(UniformSampler):
    """Clusters i.i.d. from ``π_c ∝ n_c^α``, documents by passes; see the module docstring and
    [`Sampler`][ccexp.sampling.base.Sampler] for the shared arguments.

    Args:
        alpha: the exponent α in [0, 1].

    Raises:
        CcexpError: for α outside [0, 1].
    """

    name = "temperature"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None, alpha: float = 0.5):
        if not 0.0 <= float(alpha) <= 1.0:
            raise CcexpError(f"sampler.alpha={alpha} must be in [0, 1] (1 = random's mix, 0 = uniform over clusters)")
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget)
        self.alpha = float(alpha)
        self._pi = temperature_weights(self.sizes, self.alpha)

    def weights(self) -> np.ndarray:
        """float64[K]: the probability of drawing each cluster (the policy's fixed mix)."""
        return self._pi.copy()

    def _draw(self, lane: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _TEMPERATURE_STREAM, self._blocks])
        return self._iid_documents(rng, self._pi, self.block_size)
