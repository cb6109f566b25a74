"""``uniform``: cluster-balanced sampling (SAMPLING.md, "uniform"; ClusterClip paper Fig. 1, middle).

Two levels, both *passes over pseudo-random permutations* so that no state is O(N):

* **Clusters.** The cluster stream is a sequence of *rounds*; a round is a fresh permutation of the
  clusters active when it starts (keyed by ``(seed, round)``). Every round visits each active
  cluster once, so cluster frequencies are ``1/K`` up to one round, independent of ``n_c``; with
  ``B = K`` each batch holds one document of every cluster, as in the paper's Figure 1.
* **Documents.** The ``e``-th draw from cluster ``c`` (``e`` = its exposure so far) is position
  ``e mod n_c`` of pass ``e div n_c``'s permutation of the cluster's members (keyed by
  ``(seed, c, pass)``). Repetition counts inside a cluster therefore never differ by more than one.

Then ``P(x) = 1 / (K · n_c(x))`` and the expected repetitions of ``x`` after ``D`` draws are
``D / (K · n_c(x))``. State: step, exposure[K], round index, position in the round and the round's
active mask[K] — O(K).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ccexp.sampling.base import Sampler
from ccexp.sampling.permutation import derive_keys, permute

_ROUND_STREAM = 0x524F554E  # "ROUN"
_PASS_STREAM = 0x50415353  # "PASS"


class UniformSampler(Sampler):
    """Uniform over clusters, then uniform within the cluster. See :class:`Sampler` for args."""

    name = "uniform"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, global_batch_size: int, seed: int = 0,
                 total_steps: int | None = None):
        super().__init__(labels, sizes, global_batch_size=global_batch_size, seed=seed, total_steps=total_steps)
        # members of cluster c are members[starts[c]:starts[c+1]] (a static index, not state)
        self._members = np.argsort(self.labels, kind="stable").astype(np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._round = 0
        self._round_pos = 0
        self._round_mask = self.sizes > 0
        self._round_order_cache: tuple[int, np.ndarray] | None = None

    # -- hooks for clipping policies ----------------------------------------------------------
    def _quota(self, pending: np.ndarray) -> np.ndarray | None:
        """int64[K] draws each cluster may still take (given ``pending`` draws of this batch), or
        None for unlimited."""
        return None

    def _on_no_active_cluster(self) -> None:
        raise AssertionError("unreachable without a clip")

    # -- drawing ------------------------------------------------------------------------------
    def _round_order(self) -> np.ndarray:
        if self._round_order_cache is None or self._round_order_cache[0] != self._round:
            active = np.flatnonzero(self._round_mask)
            pos = permute(np.arange(active.size), active.size, derive_keys(self.seed, _ROUND_STREAM, self._round))
            self._round_order_cache = (self._round, active[pos])
        return self._round_order_cache[1]

    def _next_clusters(self, count: int) -> np.ndarray:
        """The next ``count`` clusters of the round stream, skipping clusters without quota."""
        chosen: list[np.ndarray] = []
        pending = np.zeros(self.num_clusters, dtype=np.int64)  # this batch's draws so far
        need = count
        while need:
            rest = self._round_order()[self._round_pos:]
            quota = self._quota(pending)
            ok_at = np.arange(rest.size) if quota is None else np.flatnonzero(quota[rest] > 0)
            take = rest[ok_at[:need]]
            pending[take] += 1  # a round holds each cluster once, so no duplicates here
            chosen.append(take)
            need -= take.size
            if need == 0:
                self._round_pos += int(ok_at[take.size - 1]) + 1
                break
            # the round is used up: start the next one over the clusters still active
            self._round += 1
            self._round_pos = 0
            quota = self._quota(pending)
            self._round_mask = self.sizes > 0 if quota is None else quota > 0
            if not self._round_mask.any():
                self._on_no_active_cluster()  # raises, or resets the clip counters
                self._round_mask = self.sizes > 0
        return np.concatenate(chosen)

    def _documents_for(self, clusters: np.ndarray) -> np.ndarray:
        """Map a batch of cluster draws to documents via each cluster's pass permutations."""
        order = np.argsort(clusters, kind="stable")
        sorted_c = clusters[order]
        first = np.searchsorted(sorted_c, sorted_c, side="left")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size) - first  # draws of the same cluster earlier in the batch
        g = self._exposure[clusters] + rank
        n = self.sizes[clusters]
        pass_idx, i = np.divmod(g, n)
        pos = permute(i, n, derive_keys(self.seed, _PASS_STREAM, clusters, pass_idx))
        self._exposure += np.bincount(clusters, minlength=self.num_clusters)
        return self._members[self._starts[clusters] + pos]

    def _draw(self, step: int) -> np.ndarray:
        return self._documents_for(self._next_clusters(self.global_batch_size))

    def max_repetition(self) -> int:
        nz = self.sizes > 0
        return int((-(-self._exposure[nz] // self.sizes[nz])).max(initial=0))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "round": self._round, "round_pos": self._round_pos,
                "round_mask": self._round_mask.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._round = int(state["round"])
        self._round_pos = int(state["round_pos"])
        self._round_mask = np.asarray(state["round_mask"], dtype=bool).copy()
        self._round_order_cache = None
