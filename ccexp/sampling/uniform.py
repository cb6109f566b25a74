"""``uniform``: cluster-balanced sampling (ClusterClip paper, arXiv 2402.14526, Fig. 1, middle).

Two levels, both *passes over pseudo-random permutations* so that no state is O(N):

* **Clusters.** The cluster stream is a sequence of *rounds*; a round is a fresh ordering of the
  clusters active when it starts (keyed by ``(seed, round)``, see `ccexp.sampling.permutation`). Every round visits each active
  cluster once, so cluster frequencies are ``1/K`` up to one round, independent of ``n_c``; with
  ``B = K`` each batch holds one document of every cluster, as in the paper's Figure 1.
* **Documents.** The ``e``-th draw from cluster ``c`` (``e`` = its exposure so far) is position
  ``e mod n_c`` of pass ``e div n_c``'s permutation of the cluster's members (a seeded base shuffle
  re-ordered per pass by a map keyed by ``(seed, c, pass)``). Repetition counts inside a cluster therefore never differ by more than one.

Then ``P(x) = 1 / (K · n_c(x))`` and the expected repetitions of ``x`` after ``D`` draws are
``D / (K · n_c(x))``. State: blocks drawn, exposure[K], round index, position in the round and the round's
active mask[K] — O(K).

An optional [`RepetitionClip`][ccexp.sampling.clip.RepetitionClip] (ClusterClip's, also used by ``dynamic``)
limits each cluster's draws; rounds then visit only the clusters with quota left.

Both levels run in compiled kernels (`ccexp.sampling.kernels`): the rounds' cluster orders and
the documents of a block's draws, each draw continuing its cluster's pass incrementally.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import ccexp.sampling.kernels as kernels
from ccexp.errors import CcexpError
from ccexp.sampling.base import Sampler
from ccexp.sampling.clip import RepetitionClip
from ccexp.sampling.permutation import MAX_DOMAIN, derive_keys

_ROUND_STREAM = 0x524F554E  # "ROUN"
_PASS_STREAM = 0x50415353  # "PASS"


class UniformSampler(Sampler):
    """Uniform over clusters, then uniform within the cluster. See [`Sampler`][ccexp.sampling.base.Sampler] for args;
    ``clip`` (used by the policies built on this one) limits each cluster's draws."""

    name = "uniform"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None,
                 clip: RepetitionClip | None = None):
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget)
        self.clip = clip
        if clip is not None:
            clip.check_budget(self.num_documents, self.document_tokens, self.token_budget)
        if self.sizes.max() >= MAX_DOMAIN:
            raise CcexpError(f"{self.name} sampler supports clusters of fewer than {MAX_DOMAIN:,} documents")
        # members of cluster c are members[starts[c]:starts[c+1]], shuffled once (a static index, not state)
        self._members = kernels.shuffled_groups(self.labels, self.sizes,
                                                np.random.default_rng([self.seed, _PASS_STREAM]))
        self._starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._cluster_base = np.random.default_rng([self.seed, _ROUND_STREAM]).permutation(self.num_clusters)
        self._pass_key = np.uint64(derive_keys(self.seed, _PASS_STREAM))
        self._round_key = np.uint64(derive_keys(self.seed, _ROUND_STREAM))
        self._round = 0
        self._round_pos = 0
        self._round_mask = self.sizes > 0
        self._round_order_cache: tuple[int, np.ndarray] | None = None
        self._clusters_buffer = np.empty(0, np.int64)  # reused by _next_clusters (no page faults per block)

    # -- the clip's quota --------------------------------------------------------------------
    def _quota(self, exposure: np.ndarray) -> np.ndarray | None:
        """int64[K] draws each cluster may still take at ``exposure``, or None for unlimited."""
        return None if self.clip is None else self.clip.quota(exposure)

    def _on_no_active_cluster(self) -> None:
        self.clip.exhausted(self.num_documents, self.document_tokens)  # raises, or resets the counters

    def _stops_when_exhausted(self) -> bool:
        return self.clip is not None and self.clip.ends_stream

    # -- drawing ------------------------------------------------------------------------------
    def _rounds(self, first: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """Cluster order of rounds ``first .. first+count-1`` over the current active set, concatenated
        (written to ``out``, int64[count · active], when given): round r is pass r of the active
        clusters (in base order) under the round key, so draw ``r·k + i`` of the kernel's pass stream."""
        active = self._cluster_base[self._round_mask[self._cluster_base]]
        k = active.size
        out = np.empty(count * k, np.int64) if out is None else out
        if k:
            kernels.pass_block(active, 0, k, 0, self._round_key, first * k, count * k, out, 0)
        return out

    def _round_order(self) -> np.ndarray:
        if self._round_order_cache is None or self._round_order_cache[0] != self._round:
            self._round_order_cache = (self._round, self._rounds(self._round, 1))
        return self._round_order_cache[1]

    def _next_clusters(self, count: int) -> np.ndarray:
        """The next ``count`` draws of the round stream, skipping clusters without quota.

        Returns:
            ``clusters`` int64[c], a view of a buffer the next call overwrites; ``c = count``, or fewer
            when the pool runs out and the policy [`_stops_when_exhausted`][ccexp.sampling.uniform.UniformSampler._stops_when_exhausted]. ``self._exposure`` is
            advanced; the t-th draw of cluster c here is its draw number (exposure before the call) + t.
        """
        if self._clusters_buffer.size < count:
            self._clusters_buffer = np.empty(count, np.int64)
        clusters = self._clusters_buffer[:count]
        exposure = self._exposure  # advanced in place; a round holds each cluster at most once
        need = count
        if not self._round_mask.any():  # the pool ran out at the end of the last draw: raise or reset now
            self._start_round(self._round)
        while need:
            rest = self._round_order()[self._round_pos:]
            quota = self._quota(exposure)
            ok_at = np.arange(min(need, rest.size)) if quota is None else np.flatnonzero(quota[rest] > 0)
            take = rest[ok_at[:need]]
            clusters[count - need:count - need + take.size] = take
            exposure[take] += 1
            need -= take.size
            if need == 0:
                self._round_pos += int(ok_at[take.size - 1]) + 1
                break
            if need < count and self._stops_when_exhausted() and not (self._quota(exposure) > 0).any():
                self._start_round(self._round + 1, defer_exhaustion=True)  # a short last block; the next draw raises
                break
            self._start_round(self._round + 1)
            # whole rounds that no clip can interrupt are drawn in one kernel call
            active = np.flatnonzero(self._round_mask)
            rounds = need // active.size
            if quota is not None and rounds:
                rounds = min(rounds, int(self._quota(exposure)[active].min()))
            if rounds:
                self._rounds(self._round, rounds, out=clusters[count - need:count - need + rounds * active.size])
                exposure[active] += rounds
                need -= rounds * active.size
                # the next round; if this block is complete (or may end short), an exhausted pool is
                # handled on the next draw
                self._start_round(self._round + rounds, defer_exhaustion=need == 0 or self._stops_when_exhausted())
                if need and not self._round_mask.any():
                    break  # a short last block; the next draw raises
        return clusters[:count - need]

    def _start_round(self, index: int, defer_exhaustion: bool = False) -> None:
        """Begin round ``index`` over the clusters that still have quota."""
        self._round = index
        self._round_pos = 0
        self._round_order_cache = None
        quota = self._quota(self._exposure)
        self._round_mask = self.sizes > 0 if quota is None else quota > 0
        if not self._round_mask.any() and not defer_exhaustion:
            self._on_no_active_cluster()  # raises, or resets the clip counters
            self._round_mask = self.sizes > 0

    def _round_documents(self, count: int) -> np.ndarray:
        """int64[c] documents of the next ``count`` draws of the round stream ([`_next_clusters`][ccexp.sampling.uniform.UniformSampler._next_clusters])."""
        before = self._exposure.copy()
        clusters = self._next_clusters(count)
        docs = np.empty(clusters.size, np.int64)
        kernels.pass_stream(clusters, before, self.sizes, self._starts, self._members, self._pass_key, docs)
        return docs

    def _iid_documents(self, rng: np.random.Generator, weights: np.ndarray, count: int) -> np.ndarray:
        """int64[c] documents of ``count`` i.i.d. cluster draws with probability proportional to
        ``weights`` (float[K]), never more than a cluster's quota (``c < count`` as in
        [`_next_clusters`][ccexp.sampling.uniform.UniformSampler._next_clusters]); ``self._exposure`` is advanced.

        The draws are counted per cluster (``rng.multinomial``), laid out by cluster — cluster c's
        draw numbers ``e_c, e_c + 1, …`` in turn — and put in the order ``rng.permutation`` gives
        ([`shuffle_like_numpy`][ccexp.sampling.kernels.shuffle_like_numpy] replays it on the documents themselves).
        ``rng`` is used up."""
        counts = np.zeros(self.num_clusters, dtype=np.int64)
        need = count
        while need:
            quota = self._quota(self._exposure + counts)
            w = weights if quota is None else np.where(quota > 0, weights, 0.0)
            if w.sum() <= 0:
                if quota is None or not (quota > 0).any():
                    if need < count and self._stops_when_exhausted():
                        break  # a short last block; the next draw raises
                    self._on_no_active_cluster()  # raises, or resets the clip counters
                    continue
                w = (quota > 0).astype(np.float64)  # zero weight left on the active clusters
            extra = rng.multinomial(need, w / w.sum())
            if quota is not None:
                extra = np.minimum(extra, quota.clip(min=0))
            counts += extra
            need -= int(extra.sum())
        docs = np.empty(int(counts.sum()), np.int64)
        kernels.grouped_documents(counts, self._exposure, self.sizes, self._starts, self._members, self._pass_key,
                                  docs)
        self._exposure += counts
        kernels.shuffle_like_numpy(rng, docs)
        return docs

    def _draw(self, lane: int) -> np.ndarray:
        return self._round_documents(self.block_size)

    def max_repetition(self) -> int:
        if self.clip is not None:
            return self.clip.max_repetition(self._exposure)
        nz = self.sizes > 0
        return int((-(-self._exposure[nz] // self.sizes[nz])).max(initial=0))

    def clipped(self) -> np.ndarray:
        quota = self._quota(self._exposure)
        return np.zeros(self.num_clusters, dtype=bool) if quota is None else (quota <= 0) & (self.sizes > 0)

    def active_clusters(self) -> int:
        quota = self._quota(self._exposure)
        return super().active_clusters() if quota is None else int(np.count_nonzero(quota > 0))

    def state_dict(self) -> dict[str, Any]:
        clip = {} if self.clip is None else self.clip.state_dict()
        return {**super().state_dict(), **clip, "round": self._round, "round_pos": self._round_pos,
                "round_mask": self._round_mask.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.clip is not None:
            self.clip.load_state_dict(state)
        super().load_state_dict(state)
        self._round = int(state["round"])
        self._round_pos = int(state["round_pos"])
        self._round_mask = np.asarray(state["round_mask"], dtype=bool).copy()
        self._round_order_cache = None
