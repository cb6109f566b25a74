"""The sampler protocol shared by every policy.

A policy owns the data order: it is a deterministic, resumable *stream of documents*, drawn in
blocks of ``block_size`` document indices ([`Sampler.next_block`][ccexp.sampling.base.Sampler.next_block]). Tokens, not documents, are
the unit of an optimizer step: `ccexp.data.packing.TokenStream` draws as many blocks as it
needs to fill a step's ``tokens_per_step`` and deals the step's rows to the data-parallel ranks, so
the global stream does not depend on the world size and the per-cluster exposure is known exactly.

A policy may keep several independent streams, *lanes* (CluSTER keeps one per cluster); each row of
a step is filled from the lane [`Sampler.row_lanes`][ccexp.sampling.base.Sampler.row_lanes] assigns to it. Indices refer to the
sampler's own document set (ccexp passes the training split), and ``labels[i]`` is document ``i``'s
cluster.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

import ccexp.sampling.kernels as kernels
from ccexp.errors import CcexpError


def rank_slice(items: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s contiguous share ``[r·n/W, (r+1)·n/W)`` of a step's ``n`` items (rows).

    Raises:
        ValueError: if ``rank`` is not in ``[0, world_size)`` or ``n`` is not divisible by ``world_size``
            (the config check rejects such settings before any work).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if len(items) % world_size:
        raise ValueError(f"{len(items)} rows cannot be dealt evenly to {world_size} ranks")
    per = len(items) // world_size
    return items[rank * per:(rank + 1) * per]


class Sampler(ABC):
    """Base class of the sampling policies.

    Args:
        labels: int32[N] cluster id of each document, in ``[0, K)``.
        sizes: int64[K] cluster sizes; must equal ``bincount(labels, minlength=K)``.
        block_size: documents per [`next_block`][ccexp.sampling.base.Sampler.next_block] call, ``>= 1``; ccexp sizes it to about one
            optimizer step's documents. The stream of ``random``, ``uniform`` and ``clusterclip``
            (``after_clip=uniform``) does not depend on it; policies that draw i.i.d. per block do.
        seed: the stream is a deterministic function of ``(seed, state)``.
        document_tokens: int64[N] tokens each document occupies in the token stream (its tokens
            after any cap, plus the separator), when known; policies with a finite supply check
            ``token_budget`` against it.
        token_budget: tokens the run will take from the stream, when known.

    Raises:
        CcexpError: on empty input, labels outside ``[0, K)``, sizes that do not match the labels,
            or a non-positive block size.
    """

    name = "base"
    num_lanes = 1
    # True for a policy whose draws depend on the training losses (observe()): its stream cannot be
    # known before training, so no model-free plan can tell it identical to another's
    needs_feedback = False
    # the unit of given_weights(): "tokens" (shares of the training tokens) or "documents" (of the draws)
    weight_unit = "tokens"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None):
        labels = np.ascontiguousarray(labels, dtype=np.int32)
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        if labels.ndim != 1 or labels.size == 0:
            raise CcexpError("sampler: labels must be a non-empty 1-D array of cluster ids")
        if sizes.ndim != 1 or sizes.size == 0:
            raise CcexpError("sampler: sizes must be a non-empty 1-D array (one entry per cluster)")
        lo, hi, counts = kernels.label_counts(labels, sizes.size)
        if lo < 0 or hi >= sizes.size:
            raise CcexpError(f"sampler: cluster ids must lie in [0, {sizes.size}); got [{lo}, {hi}]")
        if not np.array_equal(counts, sizes):
            raise CcexpError("sampler: sizes do not match bincount(labels); pass the clustering's sizes")
        if int(block_size) < 1:
            raise CcexpError(f"sampler block_size must be >= 1, got {block_size}")
        if document_tokens is not None:
            document_tokens = np.asarray(document_tokens, dtype=np.int64)
            if document_tokens.shape != labels.shape or (document_tokens < 1).any():
                raise CcexpError("sampler: document_tokens must hold one count >= 1 per document")
        self.labels = labels
        self.sizes = sizes
        self.num_clusters = int(sizes.size)
        self.num_documents = int(labels.size)
        self.block_size = int(block_size)
        self.seed = int(seed)
        self.document_tokens = document_tokens
        self.token_budget = None if token_budget is None else int(token_budget)
        self._blocks = 0
        self._exposure = np.zeros(self.num_clusters, dtype=np.int64)

    # -- the protocol -------------------------------------------------------------------------
    def next_block(self, lane: int = 0) -> np.ndarray:
        """The next ``block_size`` document indices (int64) of lane ``lane``'s stream.

        Fewer are returned only by a clipping policy whose pool runs out mid-block (with
        ``on_exhausted=error``); the following call then raises.

        Raises:
            ValueError: if ``lane`` is not in ``[0, num_lanes)``.
            CcexpError: if a clipping policy has nothing left to draw.
        """
        if not 0 <= lane < self.num_lanes:
            raise ValueError(f"{self.name} sampler has {self.num_lanes} lane(s), asked for lane {lane}")
        docs = self._draw(lane)
        self._blocks += 1
        return docs

    @abstractmethod
    def _draw(self, lane: int) -> np.ndarray:
        """Return the next block of lane ``lane`` (int64 indices) and update the exposure counters."""

    def row_lanes(self, rows: int) -> np.ndarray:
        """int64[rows]: the lane that fills each of a step's ``rows`` rows (all 0 for one lane).

        Raises:
            CcexpError: if the policy cannot lay out ``rows`` rows (see `ClusterDPSampler`).
        """
        return np.zeros(int(rows), dtype=np.int64)

    def observe(self, step: int, cluster_loss: np.ndarray, cluster_tokens: np.ndarray) -> None:
        """Per-cluster training signal of one optimizer step, summed over its micro-batches and all
        ranks: float[K] summed token loss (nats) and int64[K] tokens. Unused here."""

    def weights(self) -> np.ndarray | None:
        """float64[K] current cluster sampling probabilities, for policies that keep them (else None)."""
        return None

    def loss_weights(self) -> np.ndarray | None:
        """float64[K] per-cluster multipliers of the training loss, or None (all 1)."""
        return None

    def average_weights(self) -> np.ndarray | None:
        """float64[K] the sampling weights averaged over training (a learned mixture) as *token shares*
        (summing to 1), for policies that learn them (else None); what ``sampler=mixture`` reuses."""
        return None

    def given_weights(self) -> np.ndarray | None:
        """float64[K] the mixture a policy was given to train on (``sampler=mixture``), in its unit
        (token shares unless the policy says otherwise), for policies that take one (else None)."""
        return None

    def mean_document_tokens(self) -> np.ndarray:
        """float64[K]: mean ``document_tokens`` of each cluster's documents (1 where the lengths are not
        known or the cluster is empty)."""
        if self.document_tokens is None:
            return np.ones(self.num_clusters)
        total = np.bincount(self.labels, weights=self.document_tokens, minlength=self.num_clusters)
        return np.divide(total, self.sizes, out=np.ones(self.num_clusters), where=self.sizes > 0)

    def notes(self) -> list[tuple[int, str]]:
        """What the run's log should say about this policy once it is built over the training documents:
        ``(logging level, line)`` pairs (none here)."""
        return []

    def exposure(self) -> np.ndarray:
        """int64[K]: documents drawn from each cluster so far."""
        return self._exposure.copy()

    @abstractmethod
    def max_repetition(self) -> int:
        """The largest number of times any single document has been drawn so far."""

    def repetition_histogram(self) -> dict[int, int]:
        """{r: number of documents drawn exactly r times so far}, computed in O(K): a cluster whose
        draws are passes over its members has ``e mod n`` documents drawn ``ceil(e/n)`` times and the
        rest ``floor(e/n)`` times (``e`` = its exposure, ``n`` = its size)."""
        return pass_histogram(self._exposure, self.sizes)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.name, "seed": self.seed, "blocks": self._blocks, "block_size": self.block_size,
                "exposure": self._exposure.copy(), "num_documents": self.num_documents}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("policy") != self.name:
            raise CcexpError(f"sampler state is for policy {state.get('policy')!r}, not {self.name!r}")
        if int(state["num_documents"]) != self.num_documents or len(state["exposure"]) != self.num_clusters:
            raise CcexpError("sampler state was saved for a different corpus or clustering")
        if int(state.get("block_size", self.block_size)) != self.block_size:
            raise CcexpError(f"sampler state was saved with blocks of {int(state['block_size'])} documents, this run "
                             f"draws {self.block_size}: resume with the same corpus, tokenizer and train.tokens_per_step")
        self.seed = int(state["seed"])
        self._blocks = int(state["blocks"])
        self._exposure = np.asarray(state["exposure"], dtype=np.int64).copy()

    # -- telemetry, for every policy --------------------------------
    def active_clusters(self) -> int:
        """Clusters that can still be drawn (all non-empty clusters unless the policy clips)."""
        return int(np.count_nonzero(self.sizes))

    def clipped(self) -> np.ndarray:
        """bool[K]: the non-empty clusters a repetition clip has taken out of the pool (none here)."""
        return np.zeros(self.num_clusters, dtype=bool)

    def telemetry(self, since: np.ndarray | None = None) -> dict[str, float]:
        """Exposure statistics: clusters still active, max and mean repetition, and the entropy (nats)
        of the sampled cluster mix with its KL divergence (nats) to the corpus mix and to uniform —
        over the whole run, and with ``since`` (an earlier [`exposure`][ccexp.sampling.base.Sampler.exposure]) also over the window
        since then (``window_*``)."""
        out = {"active_clusters": float(self.active_clusters()), "max_repetition": float(self.max_repetition()),
               "mean_repetition": float(self._exposure.sum() / self.num_documents)}
        out.update(mix_statistics(self._exposure, self.sizes))
        if since is not None:
            out.update({f"window_{k}": v for k, v in mix_statistics(self._exposure - since, self.sizes).items()})
        return out


def normalised(weights: np.ndarray) -> np.ndarray:
    """float64[K]: finite weights ``>= 0`` with a positive one, scaled to sum 1 — divided by the largest
    first, so weights whose sum overflows a float (``[1e308, 1e308]``) still give ``[0.5, 0.5]``."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.max()
    return w / w.sum()


def token_shares(document_weights: np.ndarray, mean_tokens: np.ndarray) -> np.ndarray:
    """float64[K]: the expected share of tokens of each cluster when documents are drawn with cluster
    probabilities ``document_weights`` (float[K]) from clusters whose documents hold ``mean_tokens``
    (float[K]) tokens on average: ``p_c · μ_c / Σ_j p_j · μ_j``."""
    t = np.asarray(document_weights, dtype=np.float64) * np.asarray(mean_tokens, dtype=np.float64)
    return t / t.sum() if t.sum() > 0 else t


def document_shares(token_weights: np.ndarray, mean_tokens: np.ndarray) -> np.ndarray:
    """float64[K]: the cluster draw probabilities whose expected token shares are ``token_weights``
    (the inverse of [`token_shares`][ccexp.sampling.base.token_shares]): ``t_c / μ_c / Σ_j t_j / μ_j``."""
    p = np.asarray(token_weights, dtype=np.float64) / np.asarray(mean_tokens, dtype=np.float64)
    return p / p.sum() if p.sum() > 0 else p


def mix_statistics(drawn: np.ndarray, sizes: np.ndarray) -> dict[str, float]:
    """Entropy of the cluster mix ``drawn / sum(drawn)`` and its KL divergence to the corpus mix
    (``sizes / N``) and to uniform over non-empty clusters, in nats; empty when nothing was drawn."""
    total = drawn.sum()
    if not total:
        return {}
    q = drawn / total
    nz = q > 0
    corpus = sizes / sizes.sum()
    return {"mix_entropy": float(-(q[nz] * np.log(q[nz])).sum()),
            "kl_to_corpus": float((q[nz] * np.log(q[nz] / corpus[nz])).sum()),
            "kl_to_uniform": float((q[nz] * np.log(q[nz] * np.count_nonzero(sizes))).sum())}


def pass_histogram(drawn: np.ndarray, sizes: np.ndarray) -> dict[int, int]:
    """Repetition histogram of groups whose draws are passes: see [`Sampler.repetition_histogram`][ccexp.sampling.base.Sampler.repetition_histogram]."""
    nz = sizes > 0
    full, extra = np.divmod(drawn[nz], sizes[nz])
    hist: dict[int, int] = {}
    for reps, count in ((full, sizes[nz] - extra), (full + 1, extra)):
        values = np.bincount(reps, weights=count).astype(np.int64)
        for r in np.flatnonzero(values):
            hist[int(r)] = hist.get(int(r), 0) + int(values[r])
    return dict(sorted(hist.items()))
