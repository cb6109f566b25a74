"""``random``: epoch-style shuffling of all N documents (SAMPLING.md, "random").

Draw ``p`` of the run (``p = step·B + j``) is position ``p mod N`` of epoch ``p div N``'s
permutation; each epoch's permutation is a fresh pseudo-random one keyed by ``(seed, epoch)``
(:mod:`ccexp.sampling.permutation`). Within an epoch every document appears exactly once, and
cluster ``c`` is drawn with frequency ``n_c / N``. State is the step counter only.
"""
from __future__ import annotations

import numpy as np

from ccexp.sampling.base import Sampler
from ccexp.sampling.permutation import derive_keys, permute

_EPOCH_STREAM = 0x52414E44  # "RAND"


class RandomSampler(Sampler):
    """Uniform over documents, without replacement within an epoch. See :class:`Sampler` for args."""

    name = "random"

    def _draw(self, step: int) -> np.ndarray:
        pos = step * self.global_batch_size + np.arange(self.global_batch_size, dtype=np.int64)
        epoch, i = np.divmod(pos, self.num_documents)
        docs = permute(i, self.num_documents, derive_keys(self.seed, _EPOCH_STREAM, epoch))
        self._exposure += np.bincount(self.labels[docs], minlength=self.num_clusters)
        return docs

    def max_repetition(self) -> int:
        drawn = self._step * self.global_batch_size
        return int(-(-drawn // self.num_documents))
