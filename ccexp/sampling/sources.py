"""``SourceMixture``: target token shares per *source*, any cluster policy inside each source.

A corpus is often several sources (files, or the values of a label field) mixed at a share the user
chooses, e.g. 70 % web / 30 % code — the token-share mixtures of OLMo-core / Dolma, DoReMi's domain
weights (Xie et al. 2023) given rather than learned. Cluster-balanced sampling then runs *within*
each source: ClusterClip (Shao et al. 2024) inside a mixture, each source's documents drawn by its
own instance of the configured cluster policy (issue 23).

**Choice of source, per document** (weighted fair queueing with eligibility, WF²Q, Bennett & Zhang
1996, specialised to sources that never run dry). Let ``w_s`` be the normalised target shares (only
sources with ``w_s > 0`` take part), ``x_s`` the tokens taken from source ``s`` so far,
``T = sum_s x_s`` and ``l_s`` the tokens of source ``s``'s next document (its inner policy's next
draw, peeked). Source ``s`` is *eligible* when it is not ahead, ``x_s <= w_s · T``; the next document
comes from the eligible source with the smallest *deadline* ``(x_s + l_s) / w_s`` (ties: lowest
source id). Some source is always eligible, as ``T`` is the ``w``-weighted mean of ``x_s / w_s``.

**Bound** (``L`` = the largest ``document_tokens`` of a document of a source with weight > 0). After
every document of the stream, for every source ``s``::

    -L  <=  -((1 - w_s) · l_s + w_s · L)  <=  x_s - w_s · T  <=  (1 - w_s) · L  <=  L

where ``l_s`` is the pending (next) document of ``s``. Between two document boundaries each
``x_s - w_s T`` moves linearly, so the bound holds at every token of the stream too: the shares hold
"to the token" up to one document.

*Proof.* Upper side: only an eligible source (``x_s - w_s T <= 0``) is chosen, and taking a
document of ``l <= L`` tokens adds ``(1 - w_s) · l`` to its ``x_s - w_s T``; every other source's
value decreases. Lower side: see source ``s``'s ``j``-th document as a job of size ``l_j`` on a
machine that does one token per unit of time ``T``, released at ``a_j = c_{j-1} / w_s`` and due at
``b_j = c_j / w_s`` (``c_j``: tokens of ``s``'s first ``j`` documents). Any set of jobs released at
or after ``t`` and due by ``t'`` totals at most ``sum_s w_s (t' - t) = t' - t`` (per source they are
consecutive documents spanning at most ``w_s (t' - t)`` tokens), so the fluid schedule meets every
deadline. The rule above is non-preemptive earliest-deadline-first among released jobs (eligible =
released), and the machine never idles. Job ``j`` completes at ``C_j <= b_j + L``: let ``q`` be the
last job started before ``j`` with a deadline ``> b_j`` (started at ``t``); every job run from
``q``'s end to ``C_j`` (``j`` included) is due by ``b_j`` and, as EDF preferred ``q`` at ``t``,
released after ``t``, so they total at most ``b_j - t`` and ``C_j <= t + l_q + b_j - t <= b_j + L``
(without such a ``q``, ``C_j <= b_j``). At a boundary ``T`` where ``j`` is ``s``'s pending document,
``T + l_j <= C_j <= (x_s + l_j) / w_s + L``, i.e. ``w_s T - x_s <= (1 - w_s) l_j + w_s L <= L``. ∎
``tests/test_source_mixture.py`` checks both sides at every prefix (hypothesis, random weights,
sizes and lengths).

**Within a source** documents come in the order its inner policy gives: ``inner(labels_s, sizes_s,
block_size=, seed=, document_tokens=, token_budget=)`` builds the configured policy over that
source's documents (``labels_s`` the *global* cluster ids, ``sizes_s = bincount(labels_s,
minlength=K)``, so cluster ids stay global); any [`Sampler`][ccexp.sampling.base.Sampler] class, or a
``functools.partial`` of one with its options, fits. Its blocks are buffered (at most one per source)
and its indices mapped back to global document indices. Its seed is derived from ``(seed, source)``
and its token budget is its share plus the bound, ``ceil(w_s · token_budget) + L``, so a clipping
policy checks its own supply up front; a source that runs out mid-run (``on_exhausted=error``)
raises its policy's CcexpError naming the source — the ratio is never silently changed.

**Feedback.** Per-cluster losses cannot be split per source, so a policy that learns from them
(``needs_feedback``, e.g. ``dynamic``) gets the *run's* per-cluster signal in every source: it
learns a cluster mix from all sources' tokens and applies it within its own source. A policy with
several lanes or loss weights (``cluster_dp``) is refused.

**State**: O(S + buffered blocks) — tokens per source, the buffers — plus the inner policies'
states; resume is exact. `exposure` counts the documents placed in the stream;
`max_repetition` and `repetition_histogram` are the inner policies' and so also count
the up to one buffered block per source they have drawn but the stream has not yet taken.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ccexp.errors import CcexpError
from ccexp.sampling.base import Sampler, normalised
from ccexp.sampling.permutation import derive_keys

_SOURCE_STREAM = 0x53524345  # "SRCE"
_KEY = "data.sources"


def normalise_source_weights(weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """float64[S]: ``weights`` (one per source) normalised to sum 1.

    Raises:
        CcexpError: one line, for weights that are not a non-empty list of numbers, a negative, NaN or
            infinite weight, or all zero.
    """
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise CcexpError(f"{_KEY}: the source weights {weights!r} are not numbers") from None
    if w.ndim != 1 or w.size == 0:
        raise CcexpError(f"{_KEY}: give the source weights as a non-empty list, one number per source; got {weights!r}")
    if not np.isfinite(w).all():
        raise CcexpError(f"{_KEY}: source weights must be finite numbers >= 0, got {w.tolist()}")
    if (w < 0).any():
        raise CcexpError(f"{_KEY}: source weights must be >= 0, got {w.tolist()}")
    if not w.max() > 0:
        raise CcexpError(f"{_KEY}: every source weight is 0; give at least one source a positive weight")
    return normalised(w)


class SourceMixture(Sampler):
    """Hold target token shares per source; the cluster policy ``inner`` runs inside each source.

    Args:
        labels: int32[N] global cluster id of each training document, in ``[0, K)``.
        sizes: int64[K] ``bincount(labels, minlength=K)``.
        sources: int[N] source id of each training document, in ``[0, S)``.
        source_weights: float[S] target shares of *tokens* (normalised); a source of weight 0 is
            never drawn (and gets no inner policy).
        inner: ``inner(labels_s, sizes_s, *, block_size, seed, document_tokens, token_budget) ->
            Sampler``, the cluster policy over one source's documents (see the module docstring);
            e.g. ``functools.partial(ClusterClipSampler, clip_threshold=4)``.
        block_size: documents per [`next_block`][ccexp.sampling.sources.SourceMixture.next_block] (and per inner block).
        seed: the stream is a deterministic function of ``(seed, state)``; source ``s``'s policy
            gets the seed [`inner_seed`][ccexp.sampling.sources.inner_seed] ``(seed, s)``.
        document_tokens: int64[N] stream tokens of each document (required: the shares are of tokens).
        token_budget: tokens the run takes from the stream, when known.
        source_names: S names for messages and notes (default ``"0"``, ``"1"``, ...).

    Raises:
        CcexpError: one line, for bad sources or weights ([`normalise_source_weights`][ccexp.sampling.sources.normalise_source_weights]; a weight list
            shorter than the source ids is a wrong count), a source with
            weight > 0 and no documents, missing ``document_tokens``, an inner policy with several
            lanes or loss weights, or an inner policy's own error (naming the source).
    """

    name = "sources"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, sources: np.ndarray,
                 source_weights: Sequence[float] | np.ndarray, inner: Callable[..., Sampler], block_size: int = 64,
                 seed: int = 0, document_tokens: np.ndarray | None = None, token_budget: int | None = None,
                 source_names: Sequence[str] | None = None):
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget)
        if self.document_tokens is None:
            raise CcexpError(f"{_KEY}: the source mixture needs document_tokens (the shares are shares of tokens)")
        src = np.asarray(sources)
        if src.shape != self.labels.shape or (src.size and not np.issubdtype(src.dtype, np.integer)):
            raise CcexpError(f"{_KEY}: sources must hold one integer source id per document "
                             f"({self.num_documents}), got shape {src.shape} of {src.dtype}")
        self.source_weights = normalise_source_weights(source_weights)
        S = self.num_sources = int(self.source_weights.size)
        if src.min() < 0 or src.max() >= S:
            raise CcexpError(f"{_KEY}: source ids must lie in [0, {S}) (one weight per source); "
                             f"got [{int(src.min())}, {int(src.max())}]")
        self.sources = src.astype(np.int64)
        self.source_names = [str(s) for s in range(S)] if source_names is None else [str(n) for n in source_names]
        if len(self.source_names) != S:
            raise CcexpError(f"{_KEY}: {len(self.source_names)} source names for {S} sources")
        counts = np.bincount(self.sources, minlength=S)
        empty = [self.source_names[s] for s in np.flatnonzero((counts == 0) & (self.source_weights > 0))]
        if empty:
            raise CcexpError(f"{_KEY}: source(s) {', '.join(empty)} have weight > 0 but no training documents")
        self._active = np.flatnonzero(self.source_weights > 0)
        in_play = np.isin(self.sources, self._active)
        self.max_document_tokens = int(self.document_tokens[in_play].max())
        # global indices of each source's documents (a static index), its policy, its buffer
        self._members: dict[int, np.ndarray] = {}
        self._inner: dict[int, Sampler] = {}
        self._buffer: dict[int, np.ndarray] = {}
        for s in self._active.tolist():
            members = np.flatnonzero(self.sources == s)
            labels_s = self.labels[members]
            budget = (None if self.token_budget is None else
                      math.ceil(self.source_weights[s] * self.token_budget) + self.max_document_tokens)
            try:
                policy = inner(labels_s, np.bincount(labels_s, minlength=self.num_clusters).astype(np.int64),
                               block_size=self.block_size, seed=inner_seed(self.seed, s),
                               document_tokens=self.document_tokens[members], token_budget=budget)
            except CcexpError as e:
                raise CcexpError(f"{_KEY}: source {self.source_names[s]}: {e}") from None
            if policy.num_lanes != 1 or policy.loss_weights() is not None:
                raise CcexpError(f"{_KEY}: the {policy.name} policy (several lanes or loss weights) cannot run inside "
                                 f"sources; choose a single-stream policy such as clusterclip or uniform")
            self._members[s], self._inner[s] = members, policy
            self._buffer[s] = np.zeros(0, np.int64)
        self.needs_feedback = any(p.needs_feedback for p in self._inner.values())
        self._taken = np.zeros(S, dtype=np.int64)  # tokens placed in the stream from each source

    # -- drawing ------------------------------------------------------------------------------------
    def _peek(self, s: int) -> int:
        """Global index of source ``s``'s next document (refilling its buffer from its policy).

        Raises:
            CcexpError: the policy's own (it ran out), naming the source.
        """
        if not self._buffer[s].size:
            try:
                block = self._inner[s].next_block()
            except CcexpError as e:
                raise CcexpError(f"{_KEY}: source {self.source_names[s]} ran out, so its share "
                                 f"{self.source_weights[s]:.3g} cannot be held: {e}") from None
            if not block.size:
                raise CcexpError(f"{_KEY}: source {self.source_names[s]} ran out (its policy returned no documents)")
            self._buffer[s] = self._members[s][block]
        return int(self._buffer[s][0])

    def _choose(self) -> int:
        """The source of the next document: the eligible one with the earliest deadline."""
        total = int(self._taken.sum())
        best, best_key = -1, math.inf
        for s in self._active.tolist():
            w, x = float(self.source_weights[s]), int(self._taken[s])
            if x > w * total:
                continue  # ahead of its share: not eligible
            key = (x + int(self.document_tokens[self._peek(s)])) / w
            if key < best_key:
                best, best_key = s, key
        if best < 0:  # rounding only: T is the w-weighted mean of x_s / w_s, so someone is not ahead
            best = int(self._active[np.argmin(self._taken[self._active] / self.source_weights[self._active])])
        return best

    def _draw(self, lane: int) -> np.ndarray:
        docs = np.empty(self.block_size, np.int64)
        for i in range(self.block_size):
            s = self._choose()
            d = self._peek(s)
            self._buffer[s] = self._buffer[s][1:]
            self._taken[s] += int(self.document_tokens[d])
            docs[i] = d
        self._exposure += np.bincount(self.labels[docs], minlength=self.num_clusters)
        return docs

    # -- feedback and telemetry ----------------------------------------------------------------------
    def observe(self, step: int, cluster_loss: np.ndarray, cluster_tokens: np.ndarray) -> None:
        """Forward the run's per-cluster signal to every inner policy that learns from it."""
        for policy in self._inner.values():
            if policy.needs_feedback:
                policy.observe(step, cluster_loss, cluster_tokens)

    def source_tokens(self) -> np.ndarray:
        """int64[S]: tokens placed in the stream from each source so far."""
        return self._taken.copy()

    def max_repetition(self) -> int:
        return max((p.max_repetition() for p in self._inner.values()), default=0)

    def repetition_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        unused = self.num_documents - sum(m.size for m in self._members.values())
        if unused:
            hist[0] = unused  # documents of weight-0 sources
        for policy in self._inner.values():
            for r, c in policy.repetition_histogram().items():
                hist[r] = hist.get(r, 0) + c
        return dict(sorted(hist.items()))

    def _drawable(self) -> np.ndarray:
        """bool[K]: clusters some source of weight > 0 can still draw."""
        out = np.zeros(self.num_clusters, dtype=bool)
        for policy in self._inner.values():
            out |= (policy.sizes > 0) & ~policy.clipped()
        return out

    def active_clusters(self) -> int:
        return int(np.count_nonzero(self._drawable()))

    def clipped(self) -> np.ndarray:
        """bool[K]: clusters of the sources with weight that every such source holding them has clipped."""
        held = np.zeros(self.num_clusters, dtype=bool)
        for policy in self._inner.values():
            held |= policy.sizes > 0
        return held & ~self._drawable()

    def notes(self) -> list[tuple[int, str]]:
        bound = self.max_document_tokens
        shares = ", ".join(f"{self.source_names[s]} {100 * self.source_weights[s]:.1f} %"
                           for s in range(self.num_sources))
        planned = ("" if not self.token_budget else
                   f" = {', '.join(f'{self.source_weights[s] * self.token_budget:,.0f}' for s in range(self.num_sources))}"
                   f" tokens of {self.token_budget:,}")
        inner = ", ".join(sorted({p.name for p in self._inner.values()}))
        return [(logging.INFO, f"sources: target token shares {shares}{planned}; planned within ±{bound:,} tokens "
                               f"(one document) of each at every step; {inner} inside each source")]

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        active = self._active.tolist()
        return {**super().state_dict(), "source_weights": self.source_weights.copy(),
                "source_tokens": self._taken.copy(),
                "buffer_counts": np.array([self._buffer[s].size for s in active], dtype=np.int64),
                "buffers": np.concatenate([self._buffer[s] for s in active]).astype(np.int64),
                "inner": {str(s): self._inner[s].state_dict() for s in active}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore [`state_dict`][ccexp.sampling.sources.SourceMixture.state_dict].

        Raises:
            CcexpError: if the state was saved for other sources, weights or corpus.
        """
        saved = np.asarray(state.get("source_weights", []), dtype=np.float64)
        if saved.shape != self.source_weights.shape or not np.allclose(saved, self.source_weights, atol=1e-12):
            raise CcexpError(f"sampler state was saved with other {_KEY} weights; resume with the same sources")
        super().load_state_dict(state)
        active = self._active.tolist()
        counts = np.asarray(state["buffer_counts"], dtype=np.int64)
        buffers = np.split(np.asarray(state["buffers"], dtype=np.int64), np.cumsum(counts)[:-1])
        for s, buf in zip(active, buffers):
            self._inner[s].load_state_dict(state["inner"][str(s)])
            self._buffer[s] = buf.copy()
        self._taken = np.asarray(state["source_tokens"], dtype=np.int64).copy()


def inner_seed(seed: int, source: int) -> int:
    """The seed of source ``source``'s policy: a hash of ``(seed, source)``, in ``[0, 2**63)``."""
    return int(derive_keys(int(seed), _SOURCE_STREAM, int(source))) >> 1
