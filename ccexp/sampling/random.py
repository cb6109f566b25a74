"""``random``: epoch-style shuffling of all N documents.

Draw ``p`` of the run (the p-th document of the stream) is position ``p mod N`` of epoch
``p div N``'s permutation: a seeded base shuffle of all documents, re-ordered each epoch by an affine
map keyed by ``(seed, epoch)`` (`ccexp.sampling.permutation`). Within an epoch every document
appears exactly once, and cluster ``c`` is drawn with frequency ``n_c / N``. State: the number of
documents drawn.

The base order is kept as int64 words ``document | cluster << 32`` (8 bytes a document), so a draw
reads one cache line for the document and its cluster's exposure count; the walk along the epoch's
affine map is a compiled kernel (`ccexp.sampling.kernels.pass_block_labelled`).
"""
from __future__ import annotations

import numpy as np

import ccexp.sampling.kernels as kernels
from ccexp.errors import CcexpError
from ccexp.sampling.base import Sampler, pass_histogram
from ccexp.sampling.permutation import MAX_DOMAIN, derive_keys

_EPOCH_STREAM = 0x52414E44  # "RAND"


class RandomSampler(Sampler):
    """Uniform over documents, without replacement within an epoch. See [`Sampler`][ccexp.sampling.base.Sampler] for args.

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
        # the base shuffle is rng.permutation(N), applied to (document, cluster) words
        self._base = kernels.shuffled_packed(self.labels, np.random.default_rng([self.seed, _EPOCH_STREAM]))
        self._key = np.uint64(derive_keys(self.seed, _EPOCH_STREAM))

    def _drawn(self) -> int:
        return self._blocks * self.block_size  # every block is full

    def _draw(self, lane: int) -> np.ndarray:
        """Draw ``p`` is position ``p mod N`` of pass (epoch) ``p div N`` of the one group of all documents."""
        docs = np.empty(self.block_size, np.int64)
        kernels.pass_block_labelled(self._base, self._key, self._drawn(), self.block_size, docs, self._exposure)
        return docs

    def repetition_histogram(self) -> dict[int, int]:
        return pass_histogram(np.array([self._drawn()]), np.array([self.num_documents]))

    def max_repetition(self) -> int:
        return int(-(-self._drawn() // self.num_documents))
