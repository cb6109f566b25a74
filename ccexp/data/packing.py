"""Pack sampled documents into fixed-length training sequences, keeping each token's cluster id.

Tokens of all documents live in one flat int32 array with int64 offsets (``tokens[off[d]:off[d+1]]``
is document d). A step's documents are truncated to ``max_doc_tokens``, each followed by EOS, and
concatenated; the stream is cut into rows of ``seq_len`` tokens and the last row is padded. Every
token carries its document's cluster id, so per-cluster loss is an exact scatter-add (DESIGN.md,
"Training examples").
"""
from __future__ import annotations

import numpy as np
import torch


def pack_documents(docs: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, clusters: np.ndarray, *,
                   seq_len: int, max_doc_tokens: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Pack documents ``docs`` (int64[b]) into rows.

    Returns:
        dict with ``input_ids`` (int64[R, seq_len]), ``labels`` (int64[R, seq_len], -100 on padding)
        and ``cluster_ids`` (int64[R, seq_len], -1 on padding), ``R = ceil(T / seq_len)`` for the
        ``T`` packed tokens (EOS included).
    """
    docs = np.asarray(docs, dtype=np.int64)
    starts = offsets[docs]
    lengths = np.minimum(offsets[docs + 1] - starts, max_doc_tokens)
    spans = lengths + 1  # + EOS
    total = int(spans.sum())
    row_count = max(1, -(-total // seq_len))
    flat = np.full(row_count * seq_len, pad_id, dtype=np.int64)
    cid = np.full(row_count * seq_len, -1, dtype=np.int64)
    # position of every token inside its document (0..span-1), without a Python loop over documents
    doc_of = np.repeat(np.arange(docs.size), spans)
    first = np.concatenate([[0], np.cumsum(spans)[:-1]])
    within = np.arange(total) - first[doc_of]
    is_eos = within == lengths[doc_of]
    src = starts[doc_of] + np.where(is_eos, 0, within)
    flat[:total] = np.where(is_eos, eos_id, tokens[src])
    cid[:total] = clusters[docs][doc_of]
    input_ids = torch.from_numpy(flat.reshape(row_count, seq_len))
    labels = input_ids.clone()
    labels[torch.from_numpy(cid.reshape(row_count, seq_len)) < 0] = -100
    return {"input_ids": input_ids, "labels": labels, "cluster_ids": torch.from_numpy(cid.reshape(row_count, seq_len))}
