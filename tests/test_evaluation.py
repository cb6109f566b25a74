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


def test_local_lm_eval_tasks_have_absolute_paths_and_true_continuations(tmp_path, builtin_records):
    import json

    from ccexp.evaluation.lm_eval_bridge import write_local_tasks

    recs = builtin_records[::50]
    tasks = write_local_tasks(tmp_path / "tasks", [r["text"] for r in recs], [r["domain"] for r in recs],
                              max_docs_per_task=5, mc_docs=30, seed=0)
    assert "ccexp_continuation" in tasks and "ccexp_ppl_lexicon_wordnet" in tasks
    for t in tasks:
        yaml_text = (tmp_path / "tasks" / f"{t}.yaml").read_text()
        data = yaml_text.split("test: ")[1].splitlines()[0].strip('"')
        assert data.startswith("/") and (tmp_path / "tasks" / f"{t}.jsonl").resolve() == __import__("pathlib").Path(data)
    texts = {r["text"][:1500] for r in recs}
    rows = [json.loads(line) for line in open(tmp_path / "tasks" / "ccexp_continuation.jsonl")]
    assert len(rows) == 30 and all(len(r["choices"]) == 4 for r in rows)
    assert all(r["context"] + r["choices"][r["label"]] in texts for r in rows)
    assert len({r["label"] for r in rows}) > 1  # the true answer is not always in one position


def test_the_size_quintiles_say_why_they_are_absent(caplog):
    """ppl_rare / ppl_common need two non-empty training clusters, and held-out tokens in the fifth they
    average; where they cannot be computed a warning says why, instead of the metric silently missing."""
    import logging

    nll, ntok = np.array([2.0, 4.0, 9.0]), np.array([2, 2, 3])
    with caplog.at_level(logging.WARNING, logger="ccexp"):
        one = summarize(nll, ntok, np.zeros(3, dtype=int), 1, sizes=np.array([10])).metrics
    assert "ppl_rare" not in one and "this run has 1 non-empty cluster(s); use clusterer.k >= 2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ccexp"):  # the smallest cluster (2) has no held-out document
        m = summarize(nll, ntok, np.array([0, 0, 1]), 3, sizes=np.array([50, 40, 3])).metrics
    assert "ppl_rare" not in m and m["ppl_common"] == pytest.approx(np.exp(1.5))
    assert "no ppl_rare: none of the 1 smallest training cluster(s) (2) has a held-out document" in caplog.text
