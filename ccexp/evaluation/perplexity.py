"""Held-out perplexity, overall and broken down by cluster and by label (e.g. ``domain``).

Each held-out document is scored on its first ``max_tokens`` tokens, with EOS as the first context
token so that every document token is predicted. Definitions (all perplexities are
``exp(mean token NLL in nats)``):

* ``ppl``: token-weighted over all held-out tokens;
* ``ppl_cluster/<c>``: over the tokens of cluster c's held-out documents;
* ``ppl_macro``: ``exp(mean over clusters of the cluster's mean token NLL)`` — every cluster counts
  the same, however large (the geometric mean of the per-cluster perplexities);
* ``ppl_worst``: the largest per-cluster perplexity among clusters with at least ``min_cluster_docs``
  held-out documents (a cluster scored on two documents is noise, not a worst case);
* ``ppl_rare`` / ``ppl_common``: token-weighted over the held-out documents of the clusters in the
  bottom / top quintile of training cluster size (when ``sizes`` is given);
* ``ppl_<label>/<value>``: per label value, e.g. ``ppl_domain/code.go`` (the value made a safe,
  distinct name by [`ccexp.names.safe_names`][ccexp.names.safe_names]);
* ``bpb`` / ``bpb_macro`` (when the scored bytes are given): bits per UTF-8 byte of the scored text,
  ``sum NLL / (ln 2 · sum bytes)`` over all held-out documents / the mean over clusters of each
  cluster's — unlike perplexity it does not depend on the tokenizer, so models with different
  vocabularies compare on it (Gao et al. 2020, "The Pile", §4; Heineman et al. 2025 use it too).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ccexp.names import safe_names


def scored_windows(offsets: np.ndarray, docs: np.ndarray, max_tokens: int,
                   prompt_tokens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The window [`document_nll`][ccexp.evaluation.perplexity.document_nll] reads of each document: ``begin`` (int64[n], its first token in the
    corpus token array), ``context`` (int64[n], leading tokens that are context only: the kept end of an
    instruction's prompt) and ``length`` (int64[n], tokens in the window, at most ``max_tokens``); the
    scored tokens are ``tokens[begin + context : begin + length]``."""
    docs = np.asarray(docs, dtype=np.int64)
    begin = offsets[docs].astype(np.int64)
    end = offsets[docs + 1]
    context = np.zeros(docs.size, dtype=np.int64)
    if prompt_tokens is not None:
        context = np.minimum(prompt_tokens[docs], max_tokens // 2)
        begin = begin + prompt_tokens[docs] - context
    return begin, context, np.minimum(end - begin, max_tokens).astype(np.int64)


def scored_bytes(tokenizer, tokens: np.ndarray, offsets: np.ndarray, docs: np.ndarray, max_tokens: int,
                 prompt_tokens: np.ndarray | None = None) -> np.ndarray:
    """int64[n]: UTF-8 bytes of the text of each document's scored tokens ([`scored_windows`][ccexp.evaluation.perplexity.scored_windows]),
    decoded by ``tokenizer`` — the denominator of bits per byte."""
    begin, context, length = scored_windows(offsets, docs, max_tokens, prompt_tokens)
    pieces = [np.asarray(tokens[b + c:b + n]).tolist() for b, c, n in zip(begin, context, length)]
    texts = tokenizer.batch_decode(pieces, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))


@torch.no_grad()
def document_nll(model: torch.nn.Module, tokens: np.ndarray, offsets: np.ndarray, docs: np.ndarray, *,
                 eos_id: int, pad_id: int, max_tokens: int, batch_size: int = 32,
                 device: torch.device | str = "cpu", prompt_tokens: np.ndarray | None = None,
                 ranks: tuple[int, int] = (0, 1)) -> tuple[np.ndarray, np.ndarray]:
    """Summed NLL (float64[n], nats) and scored token count (int64[n]) of each document in ``docs``,
    read from its start (after the separator) for at most ``max_tokens`` tokens.

    ``prompt_tokens`` (instruction data, int64[N] over the corpus): only response tokens are scored,
    each window holding the last at most ``max_tokens // 2`` prompt tokens as context and then the
    response, ``max_tokens`` tokens in all.

    ``ranks`` = (rank, world size) of an initialised ``torch.distributed`` group: the documents are cut into the same
    batches as on one process (by length, ``batch_size`` each) and batch b is scored by rank ``b mod world``; a rank
    with one batch fewer runs one forward pass on a two-token row, so that every rank calls ``model`` the same number
    of times (a sharded model's forward is collective), and the NLLs are summed over ranks (each document's by
    exactly one rank, so the result equals one process's bit for bit when the model computes alike). Every rank
    gets every document's NLL. ``model`` may be the FSDP root (its forward gathers the shards).
    """
    rank, world = ranks
    was_training = model.training
    model.eval()
    docs = np.asarray(docs, dtype=np.int64)
    begin, context, lengths = scored_windows(offsets, docs, max_tokens, prompt_tokens)
    nll = np.zeros(docs.size, dtype=np.float64)
    order = np.argsort(lengths, kind="stable")  # batch similar lengths together
    starts = range(0, docs.size, batch_size)
    mine = list(starts)[rank::world]
    for start in mine + [None] * (-(-len(starts) // world) - len(mine)):
        if start is None:  # this rank's share is one batch short: a forward pass to keep in step with the others
            ids_t = torch.full((1, 2), eos_id, dtype=torch.int64, device=device)
            model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t))
            continue
        sel = order[start:start + batch_size]
        width = int(lengths[sel].max()) + 1
        ids = np.full((sel.size, width), pad_id, dtype=np.int64)
        labels = np.full((sel.size, width), -100, dtype=np.int64)
        ids[:, 0] = eos_id
        for row, k in enumerate(sel):
            piece = tokens[begin[k]:begin[k] + lengths[k]]
            ids[row, 1:1 + piece.size] = piece
            labels[row, 1 + context[k]:1 + piece.size] = piece[context[k]:]
        # the model reads positions 0..L-1 (the separator, then all but the last scored token) and predicts the
        # L tokens after them: at most max_tokens positions, those a model trained on rows of seq_len has seen
        ids_t = torch.from_numpy(ids[:, :-1]).to(device)
        target = torch.from_numpy(labels[:, 1:]).to(device)
        attn = torch.from_numpy(np.arange(width - 1)[None, :] < lengths[sel][:, None]).to(device)
        logits = model(input_ids=ids_t, attention_mask=attn.long()).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100,
                               reduction="none").view_as(target)
        nll[sel] = loss.sum(dim=1).double().cpu().numpy()
    model.train(was_training)
    if world > 1:
        import torch.distributed as dist

        summed = torch.from_numpy(nll).to(device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        nll = summed.cpu().numpy()
    return nll, (lengths - context).astype(np.int64)


@dataclass
class PerplexityReport:
    metrics: dict[str, float]
    per_cluster: dict[str, np.ndarray]  # cluster -> arrays: nll, tokens, documents, ppl (each [K])
    # per scored document (arrays [n]): its corpus index, cluster, tokens, bytes and summed NLL (nats), for
    # paired bootstraps over the held-out documents; None when the caller did not keep them
    per_document: dict[str, np.ndarray] | None = None


def summarize(nll: np.ndarray, ntok: np.ndarray, clusters: np.ndarray, num_clusters: int,
              labels: dict[str, list[str]] | None = None, min_cluster_docs: int = 1,
              sizes: np.ndarray | None = None, label_names: dict[str, dict[str, str]] | None = None,
              nbytes: np.ndarray | None = None) -> PerplexityReport:
    """Aggregate per-document NLL into the metrics of the module docstring (vectorised bincounts).

    Args:
        nll: float64[n] summed NLL per document; ntok: int64[n] tokens per document;
        clusters: int[n] cluster of each document; labels: name -> list of n strings;
        nbytes: int64[n] UTF-8 bytes of each document's scored text ([`scored_bytes`][ccexp.evaluation.perplexity.scored_bytes]), for ``bpb``.
    """
    clusters = np.asarray(clusters, dtype=np.int64)
    metrics = {"ppl": float(np.exp(nll.sum() / max(1, ntok.sum()))), "heldout_documents": float(nll.size),
               "heldout_tokens": float(ntok.sum())}
    c_nll = np.bincount(clusters, weights=nll, minlength=num_clusters)
    c_tok = np.bincount(clusters, weights=ntok, minlength=num_clusters)
    c_doc = np.bincount(clusters, minlength=num_clusters)
    present = c_tok > 0
    c_mean = np.full(num_clusters, np.nan)
    c_mean[present] = c_nll[present] / c_tok[present]
    c_ppl = np.exp(c_mean)
    scored = np.isfinite(c_mean)  # a model that diverged scores NaN: recorded as NaN, never a crash
    metrics["ppl_macro"] = float(np.exp(c_mean[scored].mean())) if scored.any() else float("nan")
    metrics["ppl_worst"], metrics["ppl_worst_cluster"] = _worst_cluster(c_ppl, c_doc, scored, min_cluster_docs)
    metrics["clusters_evaluated"] = float(present.sum())
    if nbytes is not None and np.sum(nbytes) > 0:
        metrics.update(_bits_per_byte(nll, nbytes, clusters, c_nll, scored, num_clusters))
    if sizes is not None and np.count_nonzero(sizes) >= 2:
        metrics.update(_size_quintile_ppl(sizes, c_nll, c_tok))
    elif sizes is not None:
        import logging

        logging.getLogger("ccexp").warning(
            "eval: no ppl_rare / ppl_common: they compare the smallest and the largest fifth of the training "
            "clusters, and this run has %d non-empty cluster(s); use clusterer.k >= 2 (>= 5 for true fifths)",
            int(np.count_nonzero(sizes)))
    for c in np.flatnonzero(present):
        metrics[f"ppl_cluster/{c:04d}"] = float(c_ppl[c])
    for name, values in (labels or {}).items():
        metrics.update(_label_ppl(name, values, nll, ntok, (label_names or {}).get(name)))
    return PerplexityReport(metrics, {"nll": c_nll, "tokens": c_tok, "documents": c_doc, "ppl": c_ppl})


def _worst_cluster(c_ppl: np.ndarray, c_doc: np.ndarray, scored: np.ndarray,
                   min_cluster_docs: int) -> tuple[float, float]:
    """``ppl_worst`` and ``ppl_worst_cluster`` (NaN and -1 when no cluster is scored)."""
    eligible = np.where((c_doc >= min_cluster_docs) & scored, c_ppl, np.nan)
    if np.isnan(eligible).all() and scored.any():
        import logging

        logging.getLogger("ccexp").warning(
            "eval: no cluster has %d held-out documents (eval.min_cluster_docs); ppl_worst is taken over every "
            "cluster and may rest on a single document", min_cluster_docs)
        eligible = np.where(scored, c_ppl, np.nan)
    worst = int(np.nanargmax(eligible)) if not np.isnan(eligible).all() else -1
    return (float(eligible[worst]) if worst >= 0 else float("nan")), float(worst)


def _bits_per_byte(nll: np.ndarray, nbytes: np.ndarray, clusters: np.ndarray, c_nll: np.ndarray, scored: np.ndarray,
                   num_clusters: int) -> dict[str, float]:
    """``bpb`` over all held-out documents and ``bpb_macro`` (the mean over scored clusters)."""
    metrics = {"bpb": float(nll.sum() / (np.log(2) * np.sum(nbytes)))}
    c_bytes = np.bincount(clusters, weights=nbytes, minlength=num_clusters)
    has = scored & (c_bytes > 0)
    metrics["bpb_macro"] = float(np.mean(c_nll[has] / (np.log(2) * c_bytes[has]))) if has.any() else float("nan")
    return metrics


def _size_quintile_ppl(sizes: np.ndarray, c_nll: np.ndarray, c_tok: np.ndarray) -> dict[str, float]:
    """``ppl_rare`` / ``ppl_common``: over the bottom / top fifth of the non-empty clusters by size (where scored)."""
    metrics = {}
    nonempty = np.flatnonzero(sizes > 0)
    by_size = nonempty[np.argsort(sizes[nonempty], kind="stable")]
    fifth = max(1, by_size.size // 5)
    for name, group in (("ppl_rare", by_size[:fifth]), ("ppl_common", by_size[-fifth:])):
        tok = c_tok[group].sum()
        if tok > 0:
            metrics[name] = float(np.exp(c_nll[group].sum() / tok))
        else:
            import logging

            logging.getLogger("ccexp").warning(
                "eval: no %s: none of the %d %s training cluster(s) (%s) has a held-out document; a larger "
                "held-out split (data.heldout_fraction) or fewer clusters gives it one", name, group.size,
                "smallest" if name == "ppl_rare" else "largest", ", ".join(map(str, group[:8].tolist())))
    return metrics


def _label_ppl(name: str, values: list[str], nll: np.ndarray, ntok: np.ndarray,
               safe: dict[str, str] | None) -> dict[str, float]:
    """``ppl_<name>/<value>`` for each value of label ``name`` with scored tokens."""
    uniq, inv = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    l_nll = np.bincount(inv, weights=nll, minlength=uniq.size)
    l_tok = np.bincount(inv, weights=ntok, minlength=uniq.size)
    # label values come from data: any string must make a valid, distinct name (the corpus-wide map
    # when given, so that names agree across runs and with the saved labels/<label>.json)
    safe = safe or safe_names(uniq)
    return {f"ppl_{name}/{safe[u]}": float(np.exp(a / b)) for u, a, b in zip(uniq, l_nll, l_tok) if b > 0}
