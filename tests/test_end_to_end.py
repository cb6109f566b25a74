"""The whole pipeline through the real CLI: a three-sampler multirun on a small real corpus, logged to
a real MLflow SQLite store, sharing one embedding and one clustering."""
from __future__ import annotations

import re

import pytest
from mlflow import MlflowClient

from conftest import ROOT, run_ccexp

TINY = ["data=jsonl", "data.label_fields=[domain]", "data.heldout_fraction=0.2", "clusterer.k=4", "train.steps=6", "train.global_batch_size=8",
        "train.seq_len=64", "train.max_doc_tokens=64", "train.warmup_steps=2", "train.log_every_n_steps=2",
        "eval.max_tokens=48", "model.n_embd=32", "model.n_head=2", "model.n_layer=1", "model.tokenizer.vocab_size=512",
        "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, small_corpus):
    out = tmp_path_factory.mktemp("outputs")
    proc = run_ccexp("-m", "sampler=random,uniform,clusterclip", f"data.path={small_corpus}", f"paths.outputs={out}",
                     *TINY, cwd=tmp_path_factory.mktemp("cwd"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc.stdout + proc.stderr


def runs(out):
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    exp = client.get_experiment_by_name("ccexp")
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def test_sweep_logs_one_finished_run_per_sampler_with_readable_names(sweep):
    out, _ = sweep
    _, rs = runs(out)
    names = [r.info.run_name for r in rs]
    for name, sampler in zip(names, ("random", "uniform", "clusterclip")):
        assert re.fullmatch(rf"jsonl-tiny_gpt-{sampler}-k4-s0-[0-9a-f]{{4}}", name), name
    assert all(r.info.status == "FINISHED" for r in rs)


def test_runs_hold_config_params_loss_and_per_cluster_and_domain_perplexity(sweep):
    out, _ = sweep
    client, rs = runs(out)
    for r in rs:
        m, p = r.data.metrics, r.data.params
        assert p["sampler.name"] == r.data.tags["sampler"] and p["train.steps"] == "6"
        assert 1 < m["eval/ppl"] < 1000 and m["eval/ppl_worst"] >= m["eval/ppl_macro"]
        assert sum(k.startswith("eval/ppl_cluster/") for k in m) == m["eval/clusters_evaluated"] >= 2
        assert "eval/ppl_domain/lexicon.wordnet" in m and sum(k.startswith("eval/ppl_domain/") for k in m) >= 5
        assert len(client.get_metric_history(r.info.run_id, "train/loss")) >= 2
        assert "sampler/max_repetition" in m and "sampler/kl_to_corpus" in m
        arts = {a.path for a in client.list_artifacts(r.info.run_id)}
        assert {"resolved_config.yaml", "tables"} <= arts


def test_sweep_embeds_and_clusters_once(sweep):
    out, log = sweep
    _, rs = runs(out)
    reused = [(r.data.metrics["cache/embed_reused"], r.data.metrics["cache/cluster_reused"]) for r in rs]
    assert reused == [(0.0, 0.0), (1.0, 1.0), (1.0, 1.0)]
    assert len(re.findall(r"embed: .*reused=False", log)) == 1 and len(re.findall(r"embed: .*reused=True", log)) == 2
    assert len(list((out / "cache" / "embed").iterdir())) == 1
    assert len({r.data.tags["fingerprints"] for r in rs}) == 1
    assert len(list(out.glob("multirun/*/*/*/checkpoints/last.ckpt"))) == 3


def test_balanced_samplers_trained_on_a_flatter_cluster_mix_than_random(sweep):
    out, _ = sweep
    _, rs = runs(out)
    kl = {r.data.tags["sampler"]: r.data.metrics["sampler/kl_to_uniform"] for r in rs}
    assert kl["uniform"] < kl["random"] and kl["clusterclip"] < kl["random"]
