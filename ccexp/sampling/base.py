"""The sampler protocol shared by every policy (DESIGN.md, "Sampler protocol").

A policy owns the data order. For optimizer step ``t`` it returns the *global* batch of
``B = global_batch_size`` document indices; rank ``r`` of ``W`` data-parallel ranks trains on the
contiguous slice ``[r·B/W, (r+1)·B/W)`` (:func:`rank_slice`). The global stream therefore does not
depend on the world size, and the per-cluster exposure is known exactly.

Indices refer to the sampler's own document set (ccexp passes the training split), and
``labels[i]`` is document ``i``'s cluster.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ccexp.errors import CcexpError


def rank_slice(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s contiguous share of a global batch (``len(batch)`` divisible by ``world_size``)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if len(batch) % world_size:
        raise CcexpError(f"train.global_batch_size={len(batch)} is not divisible by the world size "
                         f"{world_size}; choose a multiple of {world_size}")
    per = len(batch) // world_size
    return batch[rank * per:(rank + 1) * per]


class Sampler(ABC):
    """Base class of the sampling policies.

    Args:
        labels: int32[N] cluster id of each document, in ``[0, K)``.
        sizes: int64[K] cluster sizes; must equal ``bincount(labels, minlength=K)``.
        global_batch_size: B, documents per optimizer step (all ranks together), ``>= 1``.
        seed: the stream is a deterministic function of ``(seed, step, state)``.
        total_steps: the run's length in steps, when known (policies with a finite budget check it).

    Raises:
        CcexpError: on empty input, labels outside ``[0, K)``, sizes that do not match the labels,
            or a non-positive batch size.
    """

    name = "base"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, global_batch_size: int, seed: int = 0,
                 total_steps: int | None = None):
        labels = np.ascontiguousarray(labels, dtype=np.int32)
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        if labels.ndim != 1 or labels.size == 0:
            raise CcexpError("sampler: labels must be a non-empty 1-D array of cluster ids")
        if sizes.ndim != 1 or sizes.size == 0:
            raise CcexpError("sampler: sizes must be a non-empty 1-D array (one entry per cluster)")
        if labels.min() < 0 or labels.max() >= sizes.size:
            raise CcexpError(f"sampler: cluster ids must lie in [0, {sizes.size}); got "
                             f"[{labels.min()}, {labels.max()}]")
        if not np.array_equal(np.bincount(labels, minlength=sizes.size), sizes):
            raise CcexpError("sampler: sizes do not match bincount(labels); pass the clustering's sizes")
        if int(global_batch_size) < 1:
            raise CcexpError(f"train.global_batch_size must be >= 1, got {global_batch_size}")
        self.labels = labels
        self.sizes = sizes
        self.num_clusters = int(sizes.size)
        self.num_documents = int(labels.size)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.total_steps = None if total_steps is None else int(total_steps)
        self._step = 0
        self._exposure = np.zeros(self.num_clusters, dtype=np.int64)

    # -- the protocol -------------------------------------------------------------------------
    def next_global_batch(self, step: int) -> np.ndarray:
        """Document indices (int64[B]) for optimizer step ``step``; steps must come in order.

        Raises:
            ValueError: if ``step`` is not the next step (resume with :meth:`load_state_dict`).
        """
        if step != self._step:
            raise ValueError(f"{self.name} sampler is at step {self._step}, asked for step {step}; "
                             "restore its state_dict to resume elsewhere")
        docs = self._draw(step)
        self._step += 1
        return docs

    @abstractmethod
    def _draw(self, step: int) -> np.ndarray:
        """Return int64[B] document indices for ``step`` and update the exposure counters."""

    def observe(self, step: int, cluster_loss: np.ndarray, cluster_tokens: np.ndarray) -> None:
        """Per-cluster training signal (float[K] summed token loss, int64[K] tokens); unused here."""

    def weights(self) -> np.ndarray | None:
        """float64[K] current cluster sampling probabilities, for policies that keep them (else None)."""
        return None

    def loss_weights(self) -> np.ndarray | None:
        """float64[K] per-cluster multipliers of the training loss, or None (all 1)."""
        return None

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
        return {"policy": self.name, "seed": self.seed, "step": self._step,
                "exposure": self._exposure.copy(), "num_documents": self.num_documents}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("policy") != self.name:
            raise CcexpError(f"sampler state is for policy {state.get('policy')!r}, not {self.name!r}")
        if int(state["num_documents"]) != self.num_documents or len(state["exposure"]) != self.num_clusters:
            raise CcexpError("sampler state was saved for a different corpus or clustering")
        self.seed = int(state["seed"])
        self._step = int(state["step"])
        self._exposure = np.asarray(state["exposure"], dtype=np.int64).copy()

    # -- telemetry (SAMPLING.md, "Reporting, for every policy") --------------------------------
    def active_clusters(self) -> int:
        """Clusters that can still be drawn (all non-empty clusters unless the policy clips)."""
        return int(np.count_nonzero(self.sizes))

    def telemetry(self, since: np.ndarray | None = None) -> dict[str, float]:
        """Exposure statistics: clusters still active, max and mean repetition, and the entropy (nats)
        of the sampled cluster mix with its KL divergence (nats) to the corpus mix and to uniform —
        over the whole run, and with ``since`` (an earlier :meth:`exposure`) also over the window
        since then (``window_*``)."""
        out = {"active_clusters": float(self.active_clusters()), "max_repetition": float(self.max_repetition()),
               "mean_repetition": float(self._exposure.sum() / self.num_documents)}
        out.update(mix_statistics(self._exposure, self.sizes))
        if since is not None:
            out.update({f"window_{k}": v for k, v in mix_statistics(self._exposure - since, self.sizes).items()})
        return out


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
    """Repetition histogram of groups whose draws are passes: see :meth:`Sampler.repetition_histogram`."""
    nz = sizes > 0
    full, extra = np.divmod(drawn[nz], sizes[nz])
    hist: dict[int, int] = {}
    for reps, count in ((full, sizes[nz] - extra), (full + 1, extra)):
        values = np.bincount(reps, weights=count).astype(np.int64)
        for r in np.flatnonzero(values):
            hist[int(r)] = hist.get(int(r), 0) + int(values[r])
    return dict(sorted(hist.items()))
