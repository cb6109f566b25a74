"""``random``: epoch-style shuffling of all N documents (SAMPLING.md, "random").

Draw ``p`` of the run (the p-th document of the stream) is position ``p mod N`` of epoch
``p div N``'s permutation: a seeded base shuffle of all documents, re-ordered each epoch by an affine
map keyed by ``(seed, epoch)`` (:mod:`ccexp.sampling.permutation`). Within an epoch every document
appears exactly once, and cluster ``c`` is drawn with frequency ``n_c / N``. State: the number of
documents drawn.
"""
from __future__ import annotations

import numpy as np

from ccexp.errors import CcexpError
from ccexp.sampling.base import Sampler, pass_histogram
from ccexp.sampling.permutation import MAX_DOMAIN, affine_permute, derive_keys, pass_hash

_EPOCH_STREAM = 0x52414E44  # "RAND"


class RandomSampler(Sampler):
    """Uniform over documents, without replacement within an epoch. See :class:`Sampler` for args.

    Raises:
        CcexpError: for corpora of ``2**31`` documents or more.
    """

    name = "random"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None):
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget)
        if self.num_documents >= MAX_DOMAIN:
            raise CcexpError(f"random sampler supports fewer than {MAX_DOMAIN:,} documents")
        self._base = np.random.default_rng([self.seed, _EPOCH_STREAM]).permutation(self.num_documents).astype(np.int32)
        self._key = derive_keys(self.seed, _EPOCH_STREAM)

    def _drawn(self) -> int:
        return self._blocks * self.block_size  # every block is full

    def _draw(self, lane: int) -> np.ndarray:
        pos = self._drawn() + np.arange(self.block_size, dtype=np.int64)
        epoch, i = np.divmod(pos, self.num_documents)
        docs = self._base[affine_permute(i, self.num_documents, pass_hash(self._key, np.zeros_like(epoch), epoch))]
        docs = docs.astype(np.int64)
        self._exposure += np.bincount(self.labels[docs], minlength=self.num_clusters)
        return docs

    def repetition_histogram(self) -> dict[int, int]:
        return pass_histogram(np.array([self._drawn()]), np.array([self.num_documents]))

    def max_repetition(self) -> int:
        return int(-(-self._drawn() // self.num_documents))
