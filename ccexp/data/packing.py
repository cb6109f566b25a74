"""The global token stream: a policy's documents packed into fixed-shape rows, a fixed number of
tokens per optimizer step: tokens are the unit of a step.

Every document enters the stream as its separator (EOS, which doubles as BOS) followed by its
tokens, so a document ``d`` of ``n_d`` tokens occupies ``n_d + 1`` stream positions (``min(n_d, cap)
+ 1`` with ``train.max_doc_tokens``; the cut tokens are counted). The stream is cut into rows of
``L = seq_len`` inputs; row ``i`` reads positions ``[iL, iL + L]`` (``L + 1`` tokens) and trains on
predicting positions ``iL + 1 .. iL + L`` from the ones before, so consecutive rows overlap by one
token and every stream token after the first is a prediction target exactly once. A step is
``R = tokens_per_step / L`` rows, hence exactly ``tokens_per_step`` targets, whatever the documents'
lengths. A document that does not fit in the room left continues in the next row and, if needed,
the next step; the carry-over (documents drawn but not yet fully consumed, and the position inside
the first) is this stream's checkpointed state. Nothing is padded and nothing is dropped.

Each target belongs to the document of its *input* position (the separator of ``d`` predicts its
first token, ``d``'s last token predicts the next separator, i.e. the end of ``d``), so per document
and per cluster the trained tokens are exact (``n_d + 1`` per occurrence), and with
``document_mask`` every prediction sees only its own document.

Rows are dealt to ranks in contiguous slices ([`ccexp.sampling.rank_slice`][ccexp.sampling.base.rank_slice]) and each rank's
slice is cut into micro-batches, so the global stream is the same for any world size. A policy with
several lanes (CluSTER: one per cluster) fills each row from the lane it assigns to that row, each
lane being its own stream with its own carry-over.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ccexp.sampling.base import Sampler


def stream_lengths(doc_tokens: np.ndarray, max_doc_tokens: int | None = None) -> np.ndarray:
    """int64[N]: positions each document occupies in the token stream, ``min(n_d, cap) + 1`` (its
    tokens after the cap, plus its separator)."""
    doc_tokens = np.asarray(doc_tokens, dtype=np.int64)
    return (doc_tokens if max_doc_tokens is None else np.minimum(doc_tokens, int(max_doc_tokens))) + 1


@dataclass
class StepPlan:
    """Which stream tokens make up one optimizer step, as segments of documents.

    The lanes' windows (``rows_in_lane · L + 1`` tokens each) are laid end to end in one virtual
    position space; segment ``s`` covers positions ``[pos[s], pos[s+1])`` with the tokens of
    document ``doc[s]`` starting at its stream offset ``start[s]`` (0 = its separator).

    Attributes:
        step: the optimizer step.
        doc: int64[S] sampler document index of each segment.
        start: int64[S] first stream offset of the segment inside its document.
        pos: int64[S+1] virtual start position of each segment (the last entry is the end).
        lane_base: int64[lanes] virtual position where each lane's window starts.
    """

    step: int
    doc: np.ndarray
    start: np.ndarray
    pos: np.ndarray
    lane_base: np.ndarray

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "doc": self.doc, "start": self.start, "pos": self.pos, "lane_base": self.lane_base}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "StepPlan":
        return cls(int(state["step"]), *(np.asarray(state[k], dtype=np.int64) for k in ("doc", "start", "pos",
                                                                                       "lane_base")))


class TokenStream:
    """Pack a sampler's document stream into the global token stream, one optimizer step at a time.

    Args:
        sampler: the policy (its indices are documents of the training split).
        doc_tokens: int64[N] tokens of each of the sampler's documents (uncapped).
        seq_len: L, input tokens per row.
        rows_per_step: R, rows per optimizer step over all ranks (``tokens_per_step / L``).
        max_doc_tokens: cap on the tokens taken from one document (None = no cap); the tokens
            beyond it are counted in `truncated_tokens`.

    Raises:
        CcexpError: from ``sampler.row_lanes`` if the policy cannot lay out ``R`` rows.
    """

    def __init__(self, sampler: Sampler, doc_tokens: np.ndarray, *, seq_len: int, rows_per_step: int,
                 max_doc_tokens: int | None = None):
        self.sampler = sampler
        self.doc_tokens = np.asarray(doc_tokens, dtype=np.int64)
        self.seq_len, self.rows_per_step = int(seq_len), int(rows_per_step)
        self.stream_len = stream_lengths(self.doc_tokens, max_doc_tokens)
        self.cut = self.doc_tokens + 1 - self.stream_len  # tokens of each document that a cap drops
        self.row_lane = sampler.row_lanes(self.rows_per_step)
        lanes = sampler.num_lanes
        self.rows_in_lane = np.bincount(self.row_lane, minlength=lanes).astype(np.int64)
        # index of each row among the rows of its lane (its window offset is that times L)
        order = np.argsort(self.row_lane, kind="stable")
        self.row_in_lane = np.empty(self.rows_per_step, dtype=np.int64)
        self.row_in_lane[order] = np.arange(self.rows_per_step) - np.repeat(np.cumsum(self.rows_in_lane)
                                                                            - self.rows_in_lane, self.rows_in_lane)
        self.step = 0  # the next step to plan
        self._pending = [np.zeros(0, dtype=np.int64) for _ in range(lanes)]  # carry-over documents per lane
        self._offset = np.zeros(lanes, dtype=np.int64)  # stream tokens of each lane's first pending doc consumed
        self.truncated_tokens = 0  # tokens cut by max_doc_tokens from the documents started so far
        self.documents_started = 0
        self.digest = ""  # a chained hash of every step's plan: equal digests = the same token stream

    @property
    def tokens_per_step(self) -> int:
        return self.rows_per_step * self.seq_len

    # -- planning ------------------------------------------------------------------------------
    def plan_step(self) -> StepPlan:
        """Draw what step `step` needs from the sampler and lay out its segments."""
        docs_out, start_out, len_out, lane_base = [], [], [], []
        base = 0
        for lane in range(self.sampler.num_lanes):
            consume = int(self.rows_in_lane[lane]) * self.seq_len
            need = consume + 1  # one token of look-ahead: the target of the lane's last input
            docs = self._pending[lane]
            avail = int(self.stream_len[docs].sum()) - int(self._offset[lane])
            blocks = [docs]
            while avail < need:
                block = self.sampler.next_block(lane)
                blocks.append(block)
                avail += int(self.stream_len[block].sum())
            docs = np.concatenate(blocks)
            start = np.zeros(docs.size, dtype=np.int64)
            start[0] = self._offset[lane]
            seg_len = self.stream_len[docs] - start
            end = np.cumsum(seg_len)  # window position where each document's segment ends
            used = int(np.searchsorted(end, need, side="left")) + 1
            length = seg_len[:used].copy()
            length[-1] -= int(end[used - 1]) - need
            docs_out.append(docs[:used])
            start_out.append(start[:used])
            len_out.append(length)
            lane_base.append(base)
            base += need
            # documents whose first position is consumed in this step count as started
            begins = end - seg_len
            started = docs[(start == 0) & (begins < consume)]
            self.documents_started += int(started.size)
            self.truncated_tokens += int(self.cut[started].sum())
            # carry-over: the first document not fully consumed, and how far into it
            first = int(np.searchsorted(end, consume, side="right"))
            self._offset[lane] = consume - int(begins[first]) + int(start[first])
            self._pending[lane] = docs[first:]
        length = np.concatenate(len_out)
        plan = StepPlan(self.step, np.concatenate(docs_out), np.concatenate(start_out),
                        np.concatenate([[0], np.cumsum(length)]).astype(np.int64), np.array(lane_base, dtype=np.int64))
        self.digest = hashlib.blake2b(self.digest.encode() + plan.doc.tobytes() + plan.start.tobytes() +
                                      plan.pos.tobytes(), digest_size=8).hexdigest()
        self.step += 1
        return plan

    # -- rows ----------------------------------------------------------------------------------
    def rows(self, plan: StepPlan, rows: np.ndarray, *, tokens: np.ndarray, offsets: np.ndarray,
             corpus_index: np.ndarray, eos_id: int, document_mask: bool,
             prompt_tokens: np.ndarray | None = None, groups: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """Materialise rows ``rows`` (int64[m], indices among the step's R rows) of ``plan``.

        Args:
            tokens, offsets: the tokenized corpus (document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``).
            corpus_index: int64[N] corpus index of each of the sampler's documents.
            eos_id: the separator token.
            document_mask: also return ``position_ids`` restarting at 0 at each document (and row)
                start; Hugging Face models then attend only within each document.
            prompt_tokens: instruction data, int64[N] prompt tokens of each corpus document: also
                return ``loss_mask`` bool[m, L], True where the target is a response token (prompt
                tokens and separators are not trained on).
            groups: int64[N] a label's value id of each corpus document: also return ``group_ids``
                int64[m, L], the value of each input's document (per-label accounting).

        Returns:
            ``input_ids``, ``labels`` (the next token of every input) and ``cluster_ids`` (the cluster
            of the input's document), each int64[m, L]; with ``document_mask`` also ``position_ids``
            int64[m, L]; and ``doc_ids`` int64[m, L] (sampler document of every input).
        """
        rows = np.asarray(rows, dtype=np.int64)
        first = self.row_in_lane[rows] * self.seq_len + plan.lane_base[self.row_lane[rows]]
        pos = first[:, None] + np.arange(self.seq_len + 1)[None, :]  # [m, L+1] virtual positions
        seg = np.searchsorted(plan.pos, pos, side="right") - 1
        doc = plan.doc[seg]
        k = plan.start[seg] + (pos - plan.pos[seg])  # stream offset inside the document (0 = separator)
        src = offsets[corpus_index[doc]] + np.maximum(k - 1, 0)
        ids = np.where(k == 0, eos_id, tokens[src]).astype(np.int64)
        out = {"input_ids": torch.from_numpy(ids[:, :-1].copy()), "labels": torch.from_numpy(ids[:, 1:].copy()),
               "cluster_ids": torch.from_numpy(self.sampler.labels[doc[:, :-1]].astype(np.int64)),
               "doc_ids": torch.from_numpy(doc[:, :-1].copy())}
        if groups is not None:
            out["group_ids"] = torch.from_numpy(groups[corpus_index[doc[:, :-1]]].astype(np.int64))
        if prompt_tokens is not None:
            target_doc = corpus_index[doc[:, 1:]]
            out["loss_mask"] = torch.from_numpy(k[:, 1:] - 1 >= prompt_tokens[target_doc])
        if document_mask:
            s = seg[:, :-1]
            col = np.arange(self.seq_len)
            begins = np.ones_like(s, dtype=bool)
            begins[:, 1:] = s[:, 1:] != s[:, :-1]
            out["position_ids"] = torch.from_numpy(col - np.maximum.accumulate(np.where(begins, col, 0), axis=1))
        return out

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The carry-over (pending documents and offset per lane), the step counter and the counts."""
        return {"step": self.step, "pending": np.concatenate(self._pending),
                "pending_count": np.array([p.size for p in self._pending], dtype=np.int64),
                "offset": self._offset.copy(), "truncated_tokens": self.truncated_tokens,
                "documents_started": self.documents_started, "rows_per_step": self.rows_per_step,
                "seq_len": self.seq_len, "digest": self.digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore [`state_dict`][ccexp.data.packing.TokenStream.state_dict].

        Raises:
            CcexpError: if the state was saved with another step shape (rows per step or seq_len).
        """
        from ccexp.errors import CcexpError

        if (int(state["rows_per_step"]), int(state["seq_len"])) != (self.rows_per_step, self.seq_len):
            raise CcexpError(f"the checkpoint's token stream has {int(state['rows_per_step'])} rows of "
                             f"{int(state['seq_len'])} tokens per step, this run {self.rows_per_step} of {self.seq_len}; "
                             "resume with the same train.tokens_per_step and train.seq_len")
        counts = np.asarray(state["pending_count"], dtype=np.int64)
        self._pending = np.split(np.asarray(state["pending"], dtype=np.int64), np.cumsum(counts)[:-1])
        self._offset = np.asarray(state["offset"], dtype=np.int64).copy()
        self.step = int(state["step"])
        self.truncated_tokens = int(state["truncated_tokens"])
        self.documents_started = int(state["documents_started"])
        self.digest = str(state.get("digest", ""))
