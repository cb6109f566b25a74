"""Semantic dedup inside clusters (SemDeDup): the keep order, chains, bad input, and recall of planted
exact and lightly edited copies in real documents with the real MiniLM embedder and FAISS k-means."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ccexp.clustering.dedup import semantic_dedup, write_dedup_report
from ccexp.config import DedupConfig
from ccexp.errors import CcexpError


def unit(x):
    x = np.asarray(x, dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_the_member_farthest_from_the_centroid_survives_and_only_within_a_cluster():
    rng = np.random.default_rng(0)
    base = unit(rng.normal(size=(6, 32)))
    vectors = np.vstack([base, base[0] + 1e-3, base[0] + 2e-3])  # docs 6 and 7 duplicate doc 0
    vectors = unit(vectors)
    labels = np.array([0, 0, 1, 1, 2, 2, 0, 0])
    centroid_sim = np.array([0.5, 0.9, 0.5, 0.5, 0.5, 0.5, 0.9, 0.1])  # doc 7 is farthest from the centroid
    hard = semantic_dedup(vectors, labels, 0.95, centroid_similarity=centroid_sim)
    assert hard.removed.tolist() == [0, 6] and hard.duplicate_of[0] == 7 and hard.duplicate_of[6] in (0, 7)
    assert np.isnan(hard.similarity[7]) and hard.similarity[0] > 0.99
    easy = semantic_dedup(vectors, labels, 0.95, centroid_similarity=centroid_sim, keep="easy")
    assert easy.removed.tolist() == [0, 7]  # doc 6 (nearest, ties by index) survives
    # the same vectors in different clusters are not compared
    apart = semantic_dedup(vectors, np.arange(8), 0.95, centroid_similarity=centroid_sim)
    assert apart.kept.all()
    # documents outside the mask are neither removed nor remove others
    masked = semantic_dedup(vectors, labels, 0.95, centroid_similarity=centroid_sim, mask=np.arange(8) != 7)
    assert masked.removed.tolist() == [6] and masked.kept[7]


def test_a_chain_is_removed_after_its_first_member_as_in_semdedup():
    a = np.array([1.0, 0.0, 0.0])
    b = np.array([np.cos(0.25), np.sin(0.25), 0.0])  # a~b and b~c above 0.96, a~c below
    c = np.array([np.cos(0.5), np.sin(0.5), 0.0])
    vectors = unit(np.vstack([a, b, c]))
    out = semantic_dedup(vectors, np.zeros(3, int), 0.96, centroid_similarity=np.array([0.1, 0.2, 0.3]))
    assert out.removed.tolist() == [1, 2]  # c goes with b (an earlier member), though a and c are apart
    assert out.duplicate_of[2] == 1


def test_results_do_not_depend_on_the_query_batch():
    rng = np.random.default_rng(1)
    base = unit(rng.normal(size=(300, 16)))
    vectors = unit(np.vstack([base, base[:100] + rng.normal(scale=0.05, size=(100, 16))]))
    labels = rng.integers(0, 3, size=400)
    labels[300:] = labels[:100]
    sim = rng.random(400)
    one = semantic_dedup(vectors, labels, 0.95, centroid_similarity=sim, query_batch=7)
    two = semantic_dedup(vectors, labels, 0.95, centroid_similarity=sim)
    assert np.array_equal(one.duplicate_of, two.duplicate_of) and one.removed.size >= 90


def test_bad_input_is_one_line():
    v = unit(np.eye(3))
    with pytest.raises(CcexpError, match=r"threshold=1.5 must be a cosine similarity in \(0, 1\]"):
        semantic_dedup(v, np.zeros(3, int), 1.5, centroid_similarity=np.zeros(3))
    with pytest.raises(CcexpError, match="keep='oldest' is not an option; use hard, easy, random"):
        semantic_dedup(v, np.zeros(3, int), 0.9, keep="oldest", centroid_similarity=np.zeros(3))
    bad = v.copy()
    bad[1] = np.nan
    with pytest.raises(CcexpError, match="NaN or inf"):
        semantic_dedup(bad, np.zeros(3, int), 0.9, centroid_similarity=np.zeros(3))


def _edit(text: str, rng) -> str:
    """A light edit: three word-level changes (upper-case a word, drop one, insert one)."""
    words = text.split(" ")
    for op in rng.permutation(3):
        i = int(rng.integers(len(words)))
        if op == 0:
            words[i] = words[i].upper()
        elif op == 1 and len(words) > 1:
            del words[i]
        else:
            words.insert(i, "very")
    return " ".join(words)


def test_planted_copies_are_found_in_real_documents_and_no_distinct_document_is_removed(builtin_records, tmp_path):
    """120 distinct prose documents of the embedded corpus, 20 exact and 20 lightly edited copies of
    some of them; real MiniLM embeddings, real FAISS k-means, the default threshold."""
    from ccexp.clustering.kmeans import FaissKMeans
    from ccexp.embedding.sentence import SentenceEmbedder

    pool = [r["text"] for r in builtin_records
            if r["domain"] in ("fiction.austen", "glossary.jargon", "satire.devils_dict") and len(r["text"]) >= 200]
    rng = np.random.default_rng(0)
    originals = [pool[i] for i in rng.choice(len(pool), 120, replace=False)]
    source = rng.choice(120, 40, replace=False)
    copies = [originals[i] for i in source[:20]] + [_edit(originals[i], rng) for i in source[20:]]
    texts = originals + copies
    vectors, _ = SentenceEmbedder(batch_size=32, max_seq_length=128).embed(texts, tmp_path / "e.npy")
    vectors = np.asarray(vectors)
    km = FaissKMeans(k=3, niter=20, seed=0).fit(vectors, np.ones(len(texts), bool))
    default = DedupConfig()
    out = semantic_dedup(vectors, km.labels, default.threshold, centroid_similarity=km.similarity, keep=default.keep)
    removed = set(out.removed.tolist())
    pairs = [(int(s), 120 + j) for j, s in enumerate(source)]
    caught = [(a in removed) != (b in removed) for a, b in pairs]  # exactly one of the two goes
    assert sum(caught[:20]) == 20  # every exact copy
    assert sum(caught[20:]) >= 18  # lightly edited copies: recall >= 90 %
    assert removed <= {d for pair in pairs for d in pair}  # no distinct document removed
    assert not any(a in removed and b in removed for a, b in pairs)
    paths = write_dedup_report(tmp_path / "report", out, labels=km.labels, k=3, texts=texts,
                               label_values={"kind": ["original"] * 120 + ["copy"] * 40},
                               train_mask=np.ones(len(texts), bool), examples=5)
    table = (tmp_path / "report" / "dedup_clusters.csv").read_text().splitlines()
    assert sum(int(line.split(",")[2]) for line in table[1:]) == len(removed)
    kinds = dict(line.split(",")[:3:2] for line in (tmp_path / "report" / "dedup_kind.csv").read_text().splitlines()[1:])
    assert int(kinds["copy"]) + int(kinds["original"]) == len(removed)
    examples = (tmp_path / "report" / "dedup_examples.md").read_text()
    assert examples.count("\n| 1.000 |") + examples.count("\n| 0.99") >= 5 and len(paths) == 3


def test_removing_or_dropping_more_than_half_of_the_training_documents_is_a_warning(tmp_path, caplog):
    """Dedup that removes most of the corpus, or a balanced selection that keeps less than half, says so
    as a warning (it was an info line)."""
    import logging

    from ccexp import stages
    from ccexp.artifacts import StageStore
    from ccexp.config import compose

    rows = [{"id": f"c{i}", "text": "the same sentence, copied word for word", "domain": "a"} for i in range(40)]
    rows += [{"id": f"u{i}", "text": f"a distinct note number {i} about topic {i * 7 % 13}", "domain": "b"}
             for i in range(20)]
    path = tmp_path / "copies.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose(["data=jsonl", f"data.path={path}", "data.label_fields=[domain]", "clusterer.k=2", "data.heldout_fraction=0.2",
                   "curate.dedup.enabled=true", "selection.target=3", f"paths.outputs={tmp_path / 'out'}"])
    stage = stages.Stages.for_config(cfg, StageStore(tmp_path / "out" / "cache"))
    corpus = stage.corpus()
    embeddings = stage.embed(corpus)
    clustering = stage.cluster(corpus, embeddings)
    with caplog.at_level(logging.WARNING, logger="ccexp"):
        kept = stage.dedup(corpus, embeddings, clustering)
        stages.select(cfg.selection, corpus, clustering, kept)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("of the training documents were removed as near-duplicates" in w for w in warnings)
    assert any("more than half were dropped (selection.target)" in w for w in warnings)
