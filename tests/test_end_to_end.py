"""The whole pipeline through the real CLI: a three-sampler x two-seed multirun on a small real corpus,
with lm-eval, logged to a real MLflow SQLite store under a parent run, sharing one embedding and one
clustering; its ClusterClip arm cannot clip at this budget, so it is flagged as uniform's duplicate
before any training and skipped; then the comparison report and the MLflow server's REST API."""
from __future__ import annotations

import re

import pytest
from mlflow import MlflowClient

from warm import python_m
from conftest import run_ccexp

TINY = ["data=jsonl", "data.label_fields=[domain]", "data.heldout_fraction=0.2", "clusterer.k=4", "train.steps=6", "train.tokens_per_step=512",
        "train.micro_batch_size=4", "train.seq_len=64", "eval.every_n_steps=3", "train.warmup_steps=2", "train.log_every_n_steps=2",
        "eval.max_tokens=48", "model.n_embd=32", "model.n_head=2", "model.n_layer=1", "model.tokenizer.vocab_size=512",
        "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, small_corpus):
    out = tmp_path_factory.mktemp("outputs")
    proc = run_ccexp("-m", "sampler=random,uniform,clusterclip", "seed=0,1", f"data.path={small_corpus}",
                     f"paths.outputs={out}", "eval=lm_eval", "eval.lm_eval.max_docs_per_task=8",
                     "eval.lm_eval.mc_docs=12", "eval.lm_eval.batch_size=8", *TINY, cwd=tmp_path_factory.mktemp("cwd"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc.stdout + proc.stderr


def runs(out, seed=None):
    """The job runs (not the sweep's parent), in launch order; only ``seed`` if given."""
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    exp = client.get_experiment_by_name("ccexp")
    rs = [r for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
          if r.data.tags.get("ccexp.sweep") != "true"]
    return client, [r for r in rs if seed is None or r.data.params["seed"] == str(seed)]


def test_sweep_logs_one_finished_run_per_job_with_readable_names(sweep):
    out, _ = sweep
    _, rs = runs(out)
    expected = [(s, seed) for s in ("random", "uniform") for seed in (0, 1)]
    assert len(rs) == 4 and all(r.info.status == "FINISHED" for r in rs)
    for r, (sampler, seed) in zip(rs, expected):
        assert re.fullmatch(rf"{sampler}-k4-s{seed}-[0-9a-f]{{4}}", r.info.run_name), r.info.run_name
        assert r.data.tags["data"] == "jsonl" and r.data.tags["model"] == "tiny_gpt"


def test_sweep_jobs_are_nested_under_one_parent_run_with_the_report(sweep):
    out, _ = sweep
    client, rs = runs(out)
    exp = client.get_experiment_by_name("ccexp")
    parents = client.search_runs([exp.experiment_id], "tags.`ccexp.sweep` = 'true'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for r in rs} == {parents[0].info.run_id}
    assert {a.path for a in client.list_artifacts(parents[0].info.run_id, "report")} >= {
        "report/report.md", "report/comparison.png", "report/comparison.csv", "report/report.html"}


def test_each_run_has_lm_eval_metrics_and_a_balance_report(sweep):
    out, _ = sweep
    client, rs = runs(out)
    for r in rs:
        m = r.data.metrics
        assert 0.0 <= m["lm_eval/ccexp_continuation/acc"] <= 1.0
        assert m["lm_eval/ccexp_ppl_lexicon_wordnet/word_perplexity"] > 1.0
        assert {"eval/ppl_rare", "eval/ppl_common"} <= set(m)
        arts = {a.path for a in client.list_artifacts(r.info.run_id, "balance")}
        assert {"balance/mix.png", "balance/mix_over_time.png", "balance/repetition.png", "balance/ppl_vs_size.png",
                "balance/balance.md", "balance/label_domain.png"} <= arts
    md = next((out / "multirun").rglob("random-s0-*/balance/balance.md")).read_text()
    rows = [ln for ln in md.split("## Per domain")[1].splitlines() if ln.startswith("| ")][1:]  # after the header
    assert len(rows) == 9  # every domain of the corpus, with its token shares and held-out perplexity
    assert abs(sum(float(r.split("|")[4]) for r in rows) - 1.0) < 1e-3  # trained-token shares add up


def test_every_sampler_trains_on_exactly_the_token_budget_with_a_held_out_curve(sweep):
    out, _ = sweep
    client, rs = runs(out)
    for r in rs:
        m = r.data.metrics
        assert m["train/tokens"] == 6 * 512  # steps x tokens_per_step, whatever the documents' lengths
        assert m["data/truncated_tokens"] == 0 and m["data/documents_started"] > 0
        curve = client.get_metric_history(r.info.run_id, "curve/ppl")
        assert [p.step for p in curve] == [0, 3 * 512, 6 * 512]  # logged against tokens trained
        assert curve[-1].value < curve[0].value
        assert len(client.get_metric_history(r.info.run_id, "curve/ppl_domain/lexicon.wordnet")) == 3
        tokens = [m[f"sampler/tokens/{c:04d}"] for c in range(4)]
        assert sum(tokens) == 6 * 512


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
    # exposure per label for every run: the tokens trained per domain add up to the run's tokens
    import csv
    import tempfile

    for r in rs:
        path = client.download_artifacts(r.info.run_id, "tables/label_domain.csv", tempfile.mkdtemp())
        rows = list(csv.DictReader(open(path)))
        assert len(rows) >= 5 and sum(int(x["train_tokens"]) for x in rows) == r.data.metrics["train/tokens"]
        assert any(x["heldout_ppl"] for x in rows) and all(x["domain"] for x in rows)


def test_two_seeds_share_one_clustering_and_the_sweep_embeds_once(sweep):
    out, log = sweep
    _, rs = runs(out)
    reused = [(r.data.metrics["cache/embed_reused"], r.data.metrics["cache/cluster_reused"]) for r in rs]
    assert reused == [(1.0, 1.0)] * 4  # computed once, before any job, by the sweep's plan of its arms
    assert len(re.findall(r"embed: .*reused=False", log)) == 1 and len(re.findall(r"cluster: .*reused=False", log)) == 1
    assert len(list((out / "cache" / "embed").iterdir())) == 1 and len(list((out / "cache" / "cluster").iterdir())) == 1
    assert len({r.data.tags["fingerprints"] for r in rs}) == 1  # seed 0 and seed 1: the same partition
    assert {r.data.params["clusterer.seed"] for r in rs} == {"0"} and {r.data.params["seed"] for r in rs} == {"0", "1"}
    assert len(list(out.glob("multirun/*/*/*/checkpoints/last.ckpt"))) == 4


def test_a_clusterclip_arm_that_cannot_clip_is_flagged_before_training_and_skipped(sweep):
    import json

    out, log = sweep
    flagged = [m.start() for m in re.finditer(r"sweep: job #\d \(sampler=clusterclip seed=\d\) would train on the "
                                              r"identical token stream as job #\d \(sampler=uniform seed=\d\): "
                                              r"skipped", log)]
    assert len(flagged) == 2 and max(flagged) < log.index("train: step")  # said before any training
    statuses = [json.loads(p.read_text()) for p in out.glob("multirun/*/*/clusterclip-*/status.json")]
    assert len(statuses) == 2 and {s["status"] for s in statuses} == {"SKIPPED"}
    assert not list(out.glob("multirun/*/*/clusterclip-*/checkpoints"))  # nothing trained
    assert "4 of 6 job(s) finished, 2 skipped as duplicate arms" in log
    report = next(out.glob("multirun/*/*/report/report.md")).read_text()
    assert "clusterclip would have trained on the identical token stream as uniform (seed 0, 1)" in report


def test_balanced_samplers_trained_on_a_flatter_cluster_mix_than_random(sweep):
    out, _ = sweep
    _, rs = runs(out, seed=0)
    kl = {r.data.tags["sampler"]: r.data.metrics["sampler/kl_to_uniform"] for r in rs}
    assert kl["uniform"] < kl["random"]


def test_comparison_report_gives_mean_and_95_ci_over_seeds(sweep, tmp_path):
    import csv
    import subprocess
    import sys

    from scipy import stats

    out, _ = sweep
    proc = python_m("ccexp.report", "--store", str(out / "mlflow.db"), "--out", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stderr
    rows = {(r["metric"], r["sampler"]): r for r in csv.DictReader(open(tmp_path / "rep" / "comparison.csv"))}
    _, rs = runs(out)
    values = [r.data.metrics["eval/ppl_macro"] for r in rs if r.data.tags["sampler"] == "uniform"]
    row = rows[("eval/ppl_macro", "uniform")]
    assert float(row["mean"]) == pytest.approx(sum(values) / 2) and row["n"] == "2"
    half = stats.t.ppf(0.975, 1) * abs(values[0] - values[1]) / 2 ** 0.5 / 2 ** 0.5
    assert float(row["ci95_half_width"]) == pytest.approx(half)
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "± " in report and f"Every run trained on exactly {6 * 512:,} tokens" in report
    # paired differences against random, seed by seed
    paired = {(r["metric"], r["sampler"]): r for r in csv.DictReader(open(tmp_path / "rep" / "paired.csv"))}
    by = {(r.data.tags["sampler"], r.data.params["seed"]): r.data.metrics["eval/ppl_macro"] for r in rs}
    diffs = [by[("uniform", s)] - by[("random", s)] for s in ("0", "1")]
    row = paired[("eval/ppl_macro", "uniform")]
    assert row["baseline"] == "random" and row["n_pairs"] == "2"
    assert float(row["mean_difference"]) == pytest.approx(sum(diffs) / 2)
    assert float(row["ci95_half_width"]) == pytest.approx(stats.t.ppf(0.975, 1) * abs(diffs[0] - diffs[1]) / 2)
    assert row["significant"] == str(int(abs(sum(diffs) / 2) > float(row["ci95_half_width"])))
    assert "## Paired differences against random" in report
    proc = python_m("ccexp.report", "--store", str(out / "mlflow.db"), "--baseline", "nope", "--out",
                    str(tmp_path / "rep2"))
    assert proc.returncode == 2 and "--baseline 'nope' has no finished run" in proc.stderr


def test_the_question_is_recorded_on_the_parent_before_the_first_job_and_another_asked_later_is_post_hoc(sweep, tmp_path):
    """Issue 61: the sweep fixes its comparison plan (primary metric, baseline, minimum effect, seeds, budget) on its
    parent run before any job starts; its report says so; a report asked another question says "post hoc"; a metric
    that favours balancing cannot be the question (one line, before any stage)."""
    import json
    from datetime import datetime, timezone

    from ccexp.compare.verdict import PLAN_TAG

    out, log = sweep
    client, rs = runs(out)
    (parent,) = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id], "tags.`ccexp.sweep` = 'true'")
    plan = json.loads(parent.data.tags[PLAN_TAG])
    assert (plan["primary"], plan["baseline"], plan["min_effect"], plan["seeds"]) == ("eval/bpb", "random", 0.02, "0,1")
    assert plan["budget"]["steps"] == 6 and plan["budget"]["tokens_per_step"] == 512
    recorded = datetime.strptime(plan["recorded"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    assert recorded * 1000 <= min(r.info.start_time for r in rs)  # before the first job's run opened
    assert "sweep: the question, fixed before the first job: bits per byte against random" in log
    report = (out / "multirun").glob("*/*/report/report.md")
    text = next(report).read_text()
    assert "**The question: bits per byte**" in text and "Fixed before the runs: the sweep's plan" in text
    assert "Post hoc" not in text
    later = python_m("ccexp.report", "--store", str(out / "mlflow.db"), "--primary", "eval/ppl", "--out",
                     str(tmp_path / "rep"))
    assert later.returncode == 0, later.stderr[-3000:]
    assert "verdict against random on overall ppl (post hoc: not the sweep's planned question)" in later.stdout
    assert "**Post hoc:** this report decides overall ppl" in (tmp_path / "rep" / "report.md").read_text()
    for refused in (python_m("ccexp.report", "--store", str(out / "mlflow.db"), "--primary", "eval/ppl_macro"),
                    run_ccexp("report.primary=eval/ppl_macro", f"paths.outputs={tmp_path / 'o'}", cwd=tmp_path)):
        lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
        assert refused.returncode == 2 and "favours balancing by construction" in lines[-1], refused.stderr[-2000:]
    assert not (tmp_path / "o" / "cache").exists()


def test_mlflow_server_serves_the_sweep_over_rest(sweep, tmp_path):
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    out, _ = sweep
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow_bin = os.path.join(os.path.dirname(sys.executable), "mlflow")
    server = subprocess.Popen([mlflow_bin, "server", "--backend-store-uri", f"sqlite:///{out}/mlflow.db",
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not answer within 60 s")

        def post(path, body):
            req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.load(r)

        exp = post("experiments/search", {"max_results": 10, "filter": "name = 'ccexp'"})["experiments"][0]
        parent = post("runs/search", {"experiment_ids": [exp["experiment_id"]],
                                      "filter": "tags.`ccexp.sweep` = 'true'"})["runs"][0]
        parent_id = parent["info"]["run_id"]
        children = post("runs/search", {"experiment_ids": [exp["experiment_id"]],
                                        "filter": f"tags.mlflow.parentRunId = '{parent_id}'"})["runs"]
        assert len(children) == 4
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_a_redirected_log_shows_progress_at_the_configured_interval(tmp_path, small_corpus):
    """Long work shows life in a file: training lines every train.log_every_n_steps (step, tokens, loss,
    tokens/s, ETA), one line per embedding shard, in the run's ccexp.log and in redirected stdout."""
    import re as _re

    from conftest import run_ccexp

    proc = run_ccexp(*TINY, f"data.path={small_corpus}", f"paths.outputs={tmp_path}", "embedder.shard_size=100",
                     "train.steps=6", "train.log_every_n_steps=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = next(tmp_path.glob("runs/*/*/ccexp.log")).read_text()
    for text in (proc.stdout, log):
        steps = [int(m) for m in _re.findall(r"train: step (\d+)/6 \(\d+%\), [\d,]+ tokens, loss [\d.]+, [\d,]+ "
                                             r"tokens/s, ETA \d+s", text)]
        assert steps == [2, 4, 6]
        shards = _re.findall(r"embed: shard (\d+)/(\d+), [\d,]+ of [\d,]+ documents, \d+ docs/s, ETA", text)
        assert len(shards) >= 3 and shards[-1][0] == shards[-1][1]


@pytest.mark.slow
def test_doremi_reference_and_semantic_dedup_through_the_cli(tmp_path, small_corpus):
    """sampler=dynamic sampler.rule=doremi trains its reference model once (a cached stage; the run's
    own numbers are the same whether it was computed or reused) and curate.dedup removes planted copies
    before the sampler sees them, with its report in MLflow."""
    import gzip
    import json

    import numpy as np

    records = [json.loads(line) for line in gzip.open(small_corpus, "rt")]
    copies = [dict(r, id=f"copy-{r['id']}") for r in records[::30]]
    corpus = tmp_path / "with_copies.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records + copies))
    args = [*TINY, f"data.path={corpus}", f"paths.outputs={tmp_path / 'out'}", "sampler=dynamic", "sampler.rule=doremi",
            "sampler.warmup_steps=1", "curate.dedup.enabled=true"]
    first = run_ccexp(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_ccexp(*args, "train.resume_from=fresh", cwd=tmp_path)  # the same run again, its stages reused
    assert second.returncode == 0, second.stderr[-3000:]
    assert "reference: a 1-step sampler=random model" in first.stdout + first.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'out'}/mlflow.db")
    exp = client.get_experiment_by_name("ccexp")
    one, two = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    assert one.data.metrics["cache/reference_reused"] == 0.0 and two.data.metrics["cache/reference_reused"] == 1.0
    assert one.data.metrics["eval/ppl"] == two.data.metrics["eval/ppl"]
    losses = np.load(next((tmp_path / "out" / "cache" / "reference").glob("*/reference_losses.npy")))
    assert losses.shape == (4,) and np.isfinite(losses).all()
    from ccexp.data.corpus import split_heldout

    held = split_heldout([r["id"] for r in records + copies], 0.2)
    both_train = sum(1 for i in range(len(copies)) if not held[30 * i] and not held[len(records) + i])
    assert both_train >= 3 and one.data.metrics["dedup/removed"] >= both_train  # one of each planted pair goes
    arts = {a.path for a in client.list_artifacts(one.info.run_id, "dedup")}
    assert {"dedup/dedup_clusters.csv", "dedup/dedup_domain.csv", "dedup/dedup_examples.md"} <= arts
    # without dedup the training split differs, so the reference is trained anew on it, not reused
    third = run_ccexp(*args[:-1], cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert len(list((tmp_path / "out" / "cache" / "reference").glob("*/reference_losses.npy"))) == 2
