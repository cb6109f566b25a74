"""Held-out perplexity aggregation: overall, macro, worst, per cluster and per label."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ccexp.evaluation.perplexity import document_nll, summarize
from ccexp.training.models import tiny_gpt


def test_summary_definitions():
    nll = np.array([2.0, 4.0, 9.0])  # summed nats per document
    ntok = np.array([2, 2, 3])
    rep = summarize(nll, ntok, np.array([0, 0, 1]), 3, {"domain": ["a", "b", "b"]})
    m = rep.metrics
    assert m["ppl"] == pytest.approx(np.exp(15 / 7))
    assert m["ppl_cluster/0000"] == pytest.approx(np.exp(1.5)) and m["ppl_cluster/0001"] == pytest.approx(np.exp(3))
    assert "ppl_cluster/0002" not in m and m["clusters_evaluated"] == 2
    assert m["ppl_macro"] == pytest.approx(np.exp((1.5 + 3) / 2))
    assert m["ppl_worst"] == pytest.approx(np.exp(3)) and m["ppl_worst_cluster"] == 1
    few = summarize(nll, ntok, np.array([0, 0, 1]), 3, min_cluster_docs=2).metrics  # cluster 1 has 1 document
    assert few["ppl_worst_cluster"] == 0 and few["ppl_worst"] == pytest.approx(np.exp(1.5))
    assert m["ppl_domain/a"] == pytest.approx(np.exp(1)) and m["ppl_domain/b"] == pytest.approx(np.exp(13 / 5))


def test_document_nll_matches_a_direct_forward_pass():
    torch.manual_seed(0)
    model = tiny_gpt(vocab_size=50, eos_id=0, n_layer=1, n_embd=16, n_head=2, n_positions=32)
    tokens = np.array([5, 6, 7, 8, 9, 10, 11], dtype=np.int32)
    offsets = np.array([0, 3, 7])
    nll, ntok = document_nll(model, tokens, offsets, np.array([0, 1]), eos_id=0, pad_id=0, max_tokens=10)
    assert ntok.tolist() == [3, 4]
    ids = torch.tensor([[0, 5, 6, 7]])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
    expect = -logp[torch.arange(3), ids[0, 1:]].sum().item()
    assert nll[0] == pytest.approx(expect, rel=1e-5)
