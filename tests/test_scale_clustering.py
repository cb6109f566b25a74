"""Sharded resumable embedding (a real kill and resume), hierarchical k-means on real embeddings of
the default corpus, balanced hierarchical selection, and the cluster report."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.clustering.hierarchical import HierarchicalKMeans
from ccexp.clustering.selection import balanced_selection, water_fill
from ccexp.clustering.report import imbalance, write_cluster_report
from ccexp.embedding.sentence import SentenceEmbedder
from ccexp.errors import CcexpError

KILL_SCRIPT = """
import sys
from ccexp.embedding.sentence import SentenceEmbedder
texts = [l.rstrip("\\n") for l in open(sys.argv[1], encoding="utf-8")]
SentenceEmbedder(batch_size=16, max_seq_length=64, shard_size=40, device="cpu").embed(texts, sys.argv[2] + "/e.npy", sys.argv[2])
"""


@pytest.fixture(scope="module")
def texts(builtin_records):
    return [" ".join(r["text"].split())[:300] for r in builtin_records[::30][:360]]


@pytest.mark.slow
def test_killed_embedding_resumes_with_unfinished_shards_only(tmp_path, texts):
    src = tmp_path / "texts.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(src), str(work)], env={**os.environ})
    deadline = time.time() + 300
    while len(list(work.glob("*.done"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = sorted(int(p.stem.split("-")[1]) for p in work.glob("*.done"))
    assert 2 <= len(done_before) < 9, "the kill should land mid-run"
    mtimes = {i: (work / f"shard-{i:06d}.npy").stat().st_mtime_ns for i in done_before}

    emb = SentenceEmbedder(batch_size=16, max_seq_length=64, shard_size=40, device="cpu")
    resumed, stats = emb.embed(texts, tmp_path / "resumed.npy", work)
    resumed = np.asarray(resumed)
    assert stats["skipped"] == done_before  # no shard embedded twice
    assert sorted(stats["embedded"] + done_before) == list(range(9))
    assert all((work / f"shard-{i:06d}.npy").stat().st_mtime_ns == t for i, t in mtimes.items())
    fresh = np.asarray(SentenceEmbedder(batch_size=16, max_seq_length=64, shard_size=40, device="cpu").embed(
        texts, tmp_path / "fresh.npy", tmp_path / "fresh_work")[0])
    assert resumed.dtype == np.float16 and resumed.shape == (360, 384)
    assert np.array_equal(resumed, fresh)


@pytest.fixture(scope="module")
def default_corpus_embeddings(builtin_records, tmp_path_factory):
    """Real MiniLM embeddings of 1,200 documents of the embedded default corpus (every domain)."""
    recs = builtin_records[::10][:1200]
    emb, _ = SentenceEmbedder(batch_size=64, max_seq_length=64, device="cpu").embed(
        [r["text"] for r in recs], tmp_path_factory.mktemp("hier") / "e.npy")
    return np.asarray(emb), [r["domain"] for r in recs], [r["text"] for r in recs]


def test_hierarchical_levels_nest_and_label_every_document(default_corpus_embeddings):
    emb, domains, _ = default_corpus_embeddings
    train = np.ones(len(emb), bool)
    train[::7] = False
    res = HierarchicalKMeans(levels=[40, 10, 3], niter=15, resampling_steps=[1, 2, 2], sample_size=[8, 2, 2],
                             seed=0).fit(emb, train)
    assert res.labels.shape == (1200,) and res.centroids.shape == (40, 384) and len(res.levels) == 3
    finer = res.labels
    for level, k in zip(res.levels[1:], (10, 3)):
        assert level.parent.size >= finer.max() + 1 and level.k == k
        assert np.array_equal(level.labels, level.parent[finer])  # nesting: a document follows its cluster
        assert level.sizes.sum() == train.sum() and level.labels.max() < k
        finer = level.labels
    again = HierarchicalKMeans(levels=[40, 10, 3], niter=15, resampling_steps=[1, 2, 2], sample_size=[8, 2, 2],
                               seed=0).fit(emb, train)
    assert np.array_equal(res.levels[2].labels, again.levels[2].labels)  # deterministic from the seed
    from ccexp.clustering.report import agreement

    assert agreement(res.levels[1].labels, domains)["purity"] > 0.6  # coarse clusters follow the domains


def test_resampling_spreads_centroids_apart(default_corpus_embeddings):
    """Vo et al.'s resampling moves centroids out of dense regions: after it, centroids are less similar
    to their nearest other centroid (the cluster sizes may grow more unequal; balanced selection
    handles that)."""
    emb, _, _ = default_corpus_embeddings
    train = np.ones(len(emb), bool)

    def nearest_centroid_similarity(c):
        sim = c @ c.T
        np.fill_diagonal(sim, -np.inf)
        return sim.max(axis=1).mean()

    plain = HierarchicalKMeans(levels=[40], niter=15, resampling_steps=0, seed=1).fit(emb, train)
    resampled = HierarchicalKMeans(levels=[40], niter=15, resampling_steps=3, sample_size=5, seed=1).fit(emb, train)
    a, b = nearest_centroid_similarity(plain.centroids), nearest_centroid_similarity(resampled.centroids)
    print(f"mean nearest-centroid cosine: plain {a:.4f}, resampled {b:.4f}")
    assert b < a


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(0, 400), st.integers(0, 2**20))
def test_water_fill_takes_small_clusters_whole_and_caps_the_rest(sizes, target, seed):
    sizes = np.array(sizes)
    t = water_fill(sizes, target, np.random.default_rng(seed))
    assert t.sum() == min(target, sizes.sum()) and (t <= sizes).all()
    if target < sizes.sum():
        capped = t < sizes
        if capped.any():
            x = t[capped].min()
            assert (t[capped] - x <= 1).all() and (sizes[~capped] <= x + 1).all()


def test_balanced_selection_hits_the_target_and_evens_out_clusters(default_corpus_embeddings):
    emb, _, _ = default_corpus_embeddings
    train = np.ones(len(emb), bool)
    res = HierarchicalKMeans(levels=[40, 8], niter=10, seed=0).fit(emb, train)
    sel = balanced_selection(res.levels, train, 400, strategy="closest", seed=0)
    assert sel.sum() == 400
    kept = np.bincount(res.labels[sel], minlength=40)
    assert imbalance(kept[kept > 0])["gini"] < imbalance(res.sizes)["gini"]
    everything = balanced_selection(res.levels, train, 5000, seed=0)
    assert everything.all()


def test_cluster_report_metrics_and_tables(default_corpus_embeddings, tmp_path):
    emb, domains, texts = default_corpus_embeddings
    train = np.ones(len(emb), bool)
    res = HierarchicalKMeans(levels=[12], niter=10, seed=0).fit(emb, train)
    m = write_cluster_report(tmp_path, labels=res.labels, sizes=res.sizes, similarity=res.similarity, texts=texts,
                             label_values={"domain": domains}, train_mask=train)
    assert 0 <= m["gini"] < 1 and 0 < m["size_entropy_norm"] <= 1 and m["max_min_ratio"] >= 1
    assert 0 < m["domain_nmi"] <= 1 and m["domain_purity"] > 0.5
    md = (tmp_path / "clusters.md").read_text()
    assert md.count("\n| ") >= 12 and "domain: " in md
    assert (tmp_path / "sizes.png").stat().st_size > 1000 and (tmp_path / "clusters.html").is_file()
    assert imbalance(np.array([5, 5, 5]))["gini"] == pytest.approx(0.0)


def test_hierarchical_rejects_bad_levels():
    with pytest.raises(CcexpError, match="strictly decreasing"):
        HierarchicalKMeans(levels=[10, 20])
    with pytest.raises(CcexpError, match="one value per level"):
        HierarchicalKMeans(levels=[10, 5], resampling_steps=[1, 2, 3])


@pytest.mark.slow
def test_cli_hierarchical_run_balances_at_a_level_on_a_curated_subset(tmp_path, small_corpus):
    from mlflow import MlflowClient

    from conftest import run_ccexp

    proc = run_ccexp("data=jsonl", f"data.path={small_corpus}", "data.label_fields=[domain]", "clusterer=hierarchical",
                     "clusterer.levels=[8,4,2]", "clusterer.resampling_steps=1", "clusterer.sample_size=3",
                     "selection.target=120", "sampler=uniform", "sampler.level=1", "train.steps=4",
                     "train.tokens_per_step=256", "train.micro_batch_size=4", "train.seq_len=64", "eval.max_tokens=32",
                     "model.n_embd=32", "model.n_head=2", "model.n_layer=1", "model.tokenizer.vocab_size=400",
                     "trainer.enable_progress_bar=false", f"paths.outputs={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "K=8/4/2" in proc.stderr + proc.stdout and "select: 120 of" in proc.stderr + proc.stdout
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])[0]
    assert "-k4l1-" in run.info.run_name
    m = run.data.metrics
    assert {"cluster/gini", "cluster/domain_nmi", "cluster/domain_purity", "cluster/max_min_ratio"} <= set(m)
    assert m["sampler/kl_to_uniform"] < 0.05  # balanced over the 4 level-1 clusters
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "clusters")}
    assert {"clusters/sizes.png", "clusters/clusters.md", "clusters/clusters.html"} <= arts
    level1 = np.load(next((tmp_path / "cache" / "cluster").iterdir()) / "level1_sizes.npy")
    assert level1.size == 4


def test_sampler_level_outside_the_clustering_is_rejected():
    from hydra import compose, initialize_config_dir

    from ccexp.__main__ import CONFIG_DIR
    from ccexp.preflight import preflight

    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("config", overrides=["sampler.level=1"])
    with pytest.raises(CcexpError, match="sampler.level=1 but clusterer=kmeans has 1 level"):
        preflight(cfg)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 100_000), min_size=1, max_size=300), st.integers(1, 40))
def test_size_histogram_counts_every_non_empty_cluster(sizes, bins):
    from ccexp.clustering.report import size_histogram

    sizes = np.array(sizes)
    if not (sizes > 0).any():
        sizes[0] = 1
    counts, edges = size_histogram(sizes, bins)
    assert counts.sum() == np.count_nonzero(sizes) and counts.size == edges.size - 1
    assert edges[0] == sizes[sizes > 0].min() and edges[-1] > sizes.max()


def test_size_histogram_keeps_the_smallest_cluster_of_105():
    """shared issue 11: log-spaced edges put 105.00000000000004 above a smallest cluster of 105."""
    from ccexp.clustering.report import size_histogram

    sizes = np.array([105, 300, 2000, 15000, 105, 7])[:-1]
    assert size_histogram(sizes)[0].sum() == 5


def test_cluster_report_table_keeps_label_values_and_texts_in_their_cells(tmp_path):
    """Label values and documents are data: a `|` or a newline in them must not add or split table cells."""
    labels = np.array([0, 0, 1, 1], dtype=np.int32)
    write_cluster_report(tmp_path, labels=labels, sizes=np.array([2, 2]), similarity=np.ones(4, np.float32),
                         texts=["a | b", "c\nd", "e", "f|g"], label_values={"src": ["x|y", "x|y", "two\nlines", "z"]},
                         train_mask=np.ones(4, bool))
    rows = [ln for ln in (tmp_path / "clusters.md").read_text().splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 2 and all(r.replace("\\|", "").count("|") == 5 for r in rows)  # four cells each
    assert any("x\\|y" in r for r in rows) and any("two lines" in r for r in rows)
