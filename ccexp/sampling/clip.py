"""ClusterClip's repetition clip as a composable quota (Shao et al. 2024, §3 and Figure 1).

A document that has been drawn ``M`` times leaves the pool. Because every policy draws inside a
cluster as passes over a permutation, "every document of cluster c has been drawn M times" is
"cluster c has completed M passes": cluster c may take ``M · n_c`` draws (between resets), and the
clip's whole state is the number of resets — O(1) on top of the sampler's exposure counters.
``uniform`` rounds and ``dynamic``'s i.i.d. draws consult [`RepetitionClip.quota`][ccexp.sampling.clip.RepetitionClip.quota]; a cluster
with no quota left is no longer drawn.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ccexp.errors import CcexpError


class RepetitionClip:
    """Per-cluster draw quota ``M · n_c`` between resets.

    Args:
        sizes: int64[K] cluster sizes.
        threshold: ``M >= 1``, the most times a document may be drawn between resets.
        on_exhausted: ``"error"`` (the stream ends when every cluster is clipped) or ``"reset"`` (the
            repetition counts start again from zero).
        setting: the config key that sets ``threshold``, named in messages.

    Raises:
        CcexpError: for ``M < 1`` or an unknown ``on_exhausted``.
    """

    def __init__(self, sizes: np.ndarray, threshold: int, on_exhausted: str = "error",
                 setting: str = "sampler.clip_threshold"):
        self.setting = setting  # the config key that sets M, for messages (UniMax's is sampler.max_epochs)
        if threshold is None or int(threshold) < 1:
            raise CcexpError(f"{setting} must be an integer >= 1, got {threshold}")
        if on_exhausted not in ("error", "reset"):
            raise CcexpError(f"sampler.on_exhausted={on_exhausted!r} is not an option; use 'error' or 'reset'")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.threshold = int(threshold)
        self.on_exhausted = on_exhausted
        self.resets = 0

    @property
    def ends_stream(self) -> bool:
        """True when an exhausted pool ends the stream (then a block may come back short)."""
        return self.on_exhausted == "error"

    def quota(self, exposure: np.ndarray) -> np.ndarray:
        """int64[K]: draws each cluster may still take before the clip (``<= 0``: clipped)."""
        return (self.resets + 1) * self.threshold * self.sizes - exposure

    def clipped_any(self, exposure: np.ndarray) -> bool:
        """True once some non-empty cluster has used its whole quota."""
        return bool(np.any((self.quota(exposure) <= 0) & (self.sizes > 0)))

    def documents_left(self, exposure: np.ndarray) -> np.ndarray:
        """int64[K]: documents of each cluster not yet drawn M times since the last reset."""
        drawn = exposure - self.resets * self.threshold * self.sizes
        return self.sizes - np.clip(drawn - (self.threshold - 1) * self.sizes, 0, self.sizes)

    def max_repetition(self, exposure: np.ndarray) -> int:
        """The most times any document has been drawn since the last reset."""
        drawn = exposure - self.resets * self.threshold * self.sizes
        nz = self.sizes > 0
        return int((-(-np.maximum(drawn[nz], 0) // self.sizes[nz])).max(initial=0))

    def exhausted(self, total_documents: int, document_tokens: np.ndarray | None) -> None:
        """Every cluster is clipped: raise (``error``) or start a new clip period (``reset``).

        Raises:
            CcexpError: with ``on_exhausted="error"``, naming the largest possible budget.
        """
        if self.on_exhausted == "error":
            raise CcexpError(self.budget_message(total_documents, document_tokens))
        self.resets += 1

    def check_budget(self, total_documents: int, document_tokens: np.ndarray | None, token_budget: int | None) -> None:
        """Reject up front a run that needs more tokens than the clip allows (``on_exhausted=error``).

        Raises:
            CcexpError: if ``token_budget > M · sum(document_tokens)``.
        """
        if self.ends_stream and token_budget is not None and document_tokens is not None:
            if token_budget > self.threshold * int(np.sum(document_tokens)):
                raise CcexpError(self.budget_message(total_documents, document_tokens, token_budget))

    def budget_message(self, total_documents: int, document_tokens: np.ndarray | None,
                       token_budget: int | None = None) -> str:
        supply = f"{self.threshold * total_documents:,} document draws"
        if document_tokens is not None:
            supply += f" = {self.threshold * int(np.sum(document_tokens)):,} tokens"
        need = f"the run needs {token_budget:,} tokens; " if token_budget else "every cluster is exhausted; "
        return (f"{self.setting}={self.threshold} allows at most {supply} from {total_documents:,} training "
                f"documents; {need}raise {self.setting}, lower train.steps or train.tokens_per_step, "
                f"or set sampler.on_exhausted=reset")

    def state_dict(self) -> dict[str, Any]:
        return {"resets": self.resets, "clip_threshold": self.threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`.

        Raises:
            CcexpError: if the state was saved with another threshold.
        """
        if int(state.get("clip_threshold", self.threshold)) != self.threshold:
            raise CcexpError(f"sampler state was saved with clip_threshold={int(state['clip_threshold'])}, "
                             f"this run has {self.threshold}")
        self.resets = int(state["resets"])
