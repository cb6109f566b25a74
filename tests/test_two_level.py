"""Two-level k-means (clusterer=two_level): the proportional allotment, both levels on real embeddings
of the default corpus, exact assignment at full probing, its objective against flat k-means, and the
coarse level as a sampler level."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.clustering.kmeans import FaissKMeans, assign
from ccexp.clustering.two_level import TwoLevelKMeans, allot
from ccexp.embedding.sentence import SentenceEmbedder
from ccexp.errors import CcexpError


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=40), st.data())
def test_allot_shares_k_in_proportion_within_each_cells_points(sizes, data):
    sizes = np.array(sizes)
    nonempty = int((sizes > 0).sum())
    if nonempty == 0:
        return
    k = data.draw(st.integers(nonempty, int(sizes.sum())))
    alloc = allot(k, sizes)
    assert alloc.sum() == k
    assert ((alloc >= 1) == (sizes > 0)).all() and (alloc <= sizes).all()
    quota = k * sizes / sizes.sum()
    # a larger cell never gets fewer centroids than a smaller one
    larger = sizes[:, None] > sizes[None, :]
    assert (alloc[:, None] >= alloc[None, :])[larger].all()
    # largest remainder: where no minimum of one or cap at the cell's points binds, within one of the quota
    if ((quota >= 1) | (sizes == 0)).all() and (np.ceil(quota) <= sizes).all():
        assert (np.abs(alloc - quota) < 1 + 1e-9).all()


def test_allot_rejects_impossible_shares():
    with pytest.raises(CcexpError, match="cannot share 2 fine centroids among 3 non-empty"):
        allot(2, np.array([5, 5, 5]))
    with pytest.raises(CcexpError, match="holding 3 points"):
        allot(4, np.array([1, 2]))


@pytest.fixture(scope="module")
def embeddings(builtin_records, tmp_path_factory):
    """Real MiniLM embeddings of 1,000 documents of the embedded default corpus (every domain)."""
    recs = builtin_records[5::12][:1000]
    emb, _ = SentenceEmbedder(batch_size=64, max_seq_length=64, device="cpu").embed(
        [r["text"] for r in recs], tmp_path_factory.mktemp("two_level") / "e.npy")
    return np.asarray(emb), [r["domain"] for r in recs]


def test_two_levels_nest_and_label_every_document(embeddings):
    emb, domains = embeddings
    train = np.ones(len(emb), bool)
    train[::9] = False
    res = TwoLevelKMeans(k=49, niter=10, seed=3).fit(emb, train)
    fine, coarse = res.levels
    assert fine.k == 49 and coarse.k == 7 and res.centroids.shape == (49, 384)
    assert fine.labels.shape == coarse.labels.shape == (1000,) and fine.labels.dtype == np.int32
    assert np.array_equal(coarse.labels, coarse.parent[fine.labels])  # a document follows its cluster's cell
    assert fine.sizes.sum() == coarse.sizes.sum() == train.sum()
    assert np.array_equal(np.bincount(coarse.parent, minlength=7) > 0, np.ones(7, bool))
    for level in (fine, coarse):  # the stored similarity is the cosine to the document's own centroid
        c = level.centroids[level.labels]
        expect = (emb.astype(np.float32) * c).sum(1) / np.linalg.norm(emb.astype(np.float32), axis=1) / np.linalg.norm(c, axis=1)
        assert np.allclose(level.similarity, expect, atol=1e-4)
    again = TwoLevelKMeans(k=49, niter=10, seed=3).fit(emb, train)
    assert np.array_equal(fine.labels, again.labels) and np.array_equal(res.centroids, again.centroids)
    from ccexp.clustering.report import agreement

    assert agreement(coarse.labels, domains)["purity"] > 0.5  # the coarse cells follow the domains


def test_probing_every_cell_is_the_exact_nearest_centroid(embeddings):
    emb, _ = embeddings
    train = np.ones(len(emb), bool)
    full = TwoLevelKMeans(k=36, niter=8, seed=0, nprobe=6).fit(emb, train)
    exact, _ = assign(emb, full.centroids)
    assert np.array_equal(full.labels, exact)
    one = TwoLevelKMeans(k=36, niter=8, seed=0, nprobe=1).fit(emb, train)
    assert np.array_equal(one.centroids, full.centroids)  # probing changes the assignment only
    assert one.levels[0].similarity.mean() <= full.levels[0].similarity.mean() + 1e-6
    assert (one.labels == exact).mean() > 0.85


def test_two_level_objective_is_close_to_flat_kmeans(embeddings):
    emb, _ = embeddings
    train = np.ones(len(emb), bool)
    flat = FaissKMeans(k=64, niter=20, seed=0).fit(emb, train)
    two = TwoLevelKMeans(k=64, niter=20, seed=0).fit(emb, train)

    def inertia(c):
        x = emb.astype(np.float32)
        return float(((x - c.centroids[c.labels]) ** 2).sum(1).mean())

    print(f"inertia flat {inertia(flat):.4f}, two-level {inertia(two):.4f}")
    assert inertia(two) < 1.05 * inertia(flat)


@pytest.mark.parametrize("spherical", [True, False])
def test_duplicate_documents_leaving_coarse_cells_empty_still_label_every_document(embeddings, spherical):
    emb, _ = embeddings
    x = np.repeat(np.asarray(emb[:10], dtype=np.float32), 24, axis=0)  # 240 documents, 10 distinct texts
    res = TwoLevelKMeans(k=20, coarse_k=12, niter=5, seed=0, spherical=spherical).fit(x, np.ones(240, bool))
    fine, coarse = res.levels
    assert (coarse.sizes == 0).any()  # 12 cells for 10 distinct points: some stay empty
    assert fine.labels.min() >= 0 and fine.labels.max() < 20 and np.array_equal(coarse.labels, coarse.parent[fine.labels])
    assert fine.sizes.sum() == 240 and np.isfinite(fine.similarity).all()
    same = fine.labels.reshape(10, 24)
    assert (same == same[:, :1]).all()  # identical documents share a cluster


def test_two_level_rejects_bad_settings_and_nan(embeddings):
    emb, _ = embeddings
    with pytest.raises(CcexpError, match=r"clusterer.coarse_k=20 must be in 1..clusterer.k \(10\)"):
        TwoLevelKMeans(k=10, coarse_k=20)
    with pytest.raises(CcexpError, match="clusterer.nprobe=0 must be >= 1"):
        TwoLevelKMeans(k=10, nprobe=0)
    with pytest.raises(CcexpError, match="asks for 10 clusters but the corpus has 5 training documents"):
        TwoLevelKMeans(k=10).fit(emb[:5], np.ones(5, bool))
    bad = np.array(emb[:200], dtype=np.float32)
    bad[7, 3] = np.nan
    with pytest.raises(CcexpError, match="NaN or inf"):
        TwoLevelKMeans(k=16, niter=2).fit(bad, np.ones(200, bool))


def test_two_level_coarse_level_is_a_sampler_level():
    from hydra import compose, initialize_config_dir

    from ccexp.__main__ import CONFIG_DIR
    from ccexp.preflight import cluster_count

    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("config", overrides=["clusterer=two_level", "clusterer.k=100", "sampler.level=1"])
        assert cluster_count(cfg) == 10
        cfg = compose("config", overrides=["clusterer=two_level", "clusterer.k=100", "clusterer.coarse_k=4",
                                           "sampler.level=1"])
        assert cluster_count(cfg) == 4
        cfg = compose("config", overrides=["clusterer=two_level", "sampler.level=2"])
    with pytest.raises(CcexpError, match=r"sampler.level=2 but clusterer=two_level has 2 level\(s\) \[1024, 32\]"):
        cluster_count(cfg)


@pytest.mark.slow
def test_cli_datasets_folder_two_level_run_balances_at_the_coarse_level(tmp_path, small_corpus):
    import datasets
    from mlflow import MlflowClient

    from ccexp.data.corpus import read_corpus
    from conftest import run_ccexp

    plain = read_corpus(small_corpus, label_fields=["domain"])
    folder = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"id": list(plain.ids), "text": list(plain.texts), "domain": plain.labels["domain"]})}).save_to_disk(str(folder))
    proc = run_ccexp("data=hf_disk", f"data.path={folder}", "data.label_fields=[domain]", "data.shard_documents=50",
                     "clusterer=two_level", "clusterer.k=16", "clusterer.coarse_k=4", "sampler=uniform",
                     "sampler.level=1", "train.steps=12", "train.tokens_per_step=512", "train.micro_batch_size=8",
                     "train.seq_len=64", "eval.max_tokens=32", "model.n_embd=32", "model.n_head=2", "model.n_layer=1",
                     "model.tokenizer.vocab_size=400", "trainer.enable_progress_bar=false", f"paths.outputs={tmp_path}",
                     cwd=tmp_path)
    out = proc.stderr + proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{len(plain):,} docs" in out and f"in {-(-len(plain) // 50)} shard(s) from ds" in out
    assert "K=16/4" in out and "two-level k-means trained on" in out
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])[0]
    cluster_dir = next((tmp_path / "cache" / "cluster").iterdir())
    sizes = np.load(cluster_dir / "level1_sizes.npy")
    assert sizes.size == 4 and np.load(cluster_dir / "level1_parent.npy").size == 16
    p = sizes[sizes > 0] / sizes.sum()
    natural = float((p * np.log(p * 4)).sum())  # the corpus's own mix over the cells
    print(f"KL to uniform over the 4 cells: sampled {run.data.metrics['sampler/kl_to_uniform']:.4f}, corpus {natural:.4f}")
    assert run.data.metrics["sampler/kl_to_uniform"] < min(0.1, natural / 2)  # balanced over the coarse cells
