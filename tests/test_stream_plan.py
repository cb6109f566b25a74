"""python -m ccexp.plan: a policy's token stream without a model equals what training draws."""
from __future__ import annotations

import csv
import re
import sys

import numpy as np

from conftest import run_ccexp
from test_cases import CASES, TINY
from warm import python_m


def test_the_plan_counts_exactly_what_a_training_run_trained(tmp_path):
    import subprocess

    common = [*TINY, f"data.path={CASES / 'tiny.jsonl'}", f"paths.outputs={tmp_path / 'out'}", "sampler=clusterclip",
              "sampler.clip_threshold=2", "sampler.on_exhausted=reset", "train.steps=12", "embedder.shard_size=50",
              "eval.every_n_steps=null", "curate.dedup.enabled=true", "curate.dedup.threshold=0.8"]
    proc = run_ccexp(*common, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (table,) = (tmp_path / "out").glob("runs/*/*/tables/clusters.csv")
    trained = list(csv.DictReader(open(table)))
    plan = python_m("ccexp.plan", *common, cwd=tmp_path, timeout=600)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "reused=True" in plan.stderr  # the run's own cached stages
    removed = int(re.search(r"dedup: (\d+) near-duplicates", plan.stderr).group(1))
    assert removed > 0  # the plan draws from the same curated training split as the run
    (folder,) = (tmp_path / "out").glob("plans/*/*")
    planned = list(csv.DictReader(open(folder / "clusters.csv")))
    assert [int(r["tokens"]) for r in planned] == [int(r["train_tokens"]) for r in trained]
    assert [int(r["documents"]) for r in planned] == [int(r["exposure"]) for r in trained]
    assert [int(r["train_size"]) for r in planned] == [int(r["train_size"]) for r in trained]
    assert sum(int(r["tokens"]) for r in planned) == 12 * 512
    assert (folder / "plan.png").is_file() and "| clusterclip |" in (folder / "plan.md").read_text()


def test_a_synthetic_plan_sweeps_the_clip_threshold_onto_one_plot(tmp_path):
    from mlflow import MlflowClient

    from ccexp.plan import main

    code = main(["plan.source=synthetic", "plan.clusters=200", "plan.documents=2000", "plan.record_every=10",
                 "sampler=clusterclip", "sampler.clip_threshold=1,3", "sampler.on_exhausted=reset", "train.steps=60",
                 "train.tokens_per_step=65536", "train.seq_len=512", "train.micro_batch_size=128",
                 f"paths.outputs={tmp_path}"])
    assert code == 0
    (folder,) = tmp_path.glob("plans/*/*")
    rows = list(csv.DictReader(open(folder / "clusters.csv")))
    by = {v: [r for r in rows if r["variant"] == v] for v in ("sampler.clip_threshold=1", "sampler.clip_threshold=3")}
    assert all(len(r) == 200 for r in by.values())
    first_clip = {v: min(int(r["clipped_at_step"]) for r in rs if int(r["clipped_at_step"]) >= 0) for v, rs in by.items()}
    assert first_clip["sampler.clip_threshold=1"] < first_clip["sampler.clip_threshold=3"]  # M=1 clips sooner
    hist = list(csv.DictReader(open(folder / "history.csv")))
    # record_every is capped at steps/20: 20 points per variant (not 60/10)
    assert len(hist) == 2 * 20 and all(np.isfinite(float(h["kl_to_corpus"])) for h in hist)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp-plan")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 2 and all(r.data.tags["ccexp.plan"] == "true" for r in runs)


def test_bad_plan_input_is_one_line(tmp_path, capsys):
    from ccexp.plan import main

    assert main(["plan.source=nowhere", f"paths.outputs={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip() == "ccexp: error: plan.source='nowhere' is not an option; use corpus or synthetic"


def test_the_plan_compares_the_token_mix_with_the_corpus_token_mix():
    """Random sampling trains on the corpus mix: in tokens against the corpus's tokens its KL is ~0, even
    when cluster document lengths differ (against the document mix it would not be)."""
    from ccexp.data.simulate import simulate, synthetic_corpus
    from ccexp.sampling import RandomSampler

    labels, sizes, lengths = synthetic_corpus(8, 4000, zipf=1.0, mean_tokens=50, seed=0)
    lengths = lengths * (1 + labels)  # cluster c's documents are (c + 1) times longer
    plan = simulate(RandomSampler(labels, sizes, block_size=64, seed=0), lengths, steps=400, tokens_per_step=2048,
                    seq_len=128)
    assert plan.history["kl_to_corpus"][-1] < 0.01
    doc_mix, token_mix = sizes / sizes.sum(), plan.corpus_tokens / plan.corpus_tokens.sum()
    assert float((token_mix * np.log(token_mix / doc_mix)).sum()) > 0.1  # the two mixes do differ here


def test_a_plan_of_several_samplers_says_each_stage_line_once(tmp_path, small_corpus, caplog):
    """Two samplers on one corpus: the second reads every stage from the cache; its corpus, labels and stage
    lines (and their warnings) are not said again, and each sampler's plan line is."""
    import logging

    from ccexp.plan import main

    caplog.set_level(logging.INFO, logger="ccexp")
    assert main(["debug=tiny", "data=jsonl", f"data.path={small_corpus}", "data.label_fields=[domain]",
                 "train.max_doc_tokens=64", "sampler=random,uniform", f"paths.outputs={tmp_path}"]) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "ccexp"]
    assert [m.split(",")[0] for m in said if m.startswith("plan: ")] == ["plan: random", "plan: uniform"]
    assert sum("reused=" in m for m in said) == 4 and len(said) == len(set(said))  # corpus, tokenize, embed, cluster


def test_a_document_balanced_policy_whose_tokens_end_less_balanced_than_randoms_is_explained():
    """Issue 44: on a corpus of long documents in a few clusters, uniform gave more token imbalance than random and
    nothing said why; the plan now says that the policy balanced documents, not tokens, and names UniMax."""
    from types import SimpleNamespace

    import numpy as np

    from ccexp.plan import documents_not_tokens

    # two clusters of 100 documents each; cluster 0's documents are 10x as long (the corpus: 10:1 in tokens)
    sizes, corpus_tokens = np.array([100, 100]), np.array([10_000, 1_000])

    def plan(label, documents, tokens):
        return (label, None, SimpleNamespace(documents=np.array(documents), tokens=np.array(tokens), sizes=sizes,
                                             corpus_tokens=corpus_tokens))

    even_documents = plan("uniform", [50, 50], [5_000, 500])  # equal documents: as uneven in tokens as the corpus
    assert documents_not_tokens([even_documents]) == []
    skewed = plan("uniform", [40, 60], [8_000, 600])  # documents drawn less evenly than the corpus holds them
    assert documents_not_tokens([skewed]) == []
    sizes = np.array([300, 100])  # now the corpus holds 3x the documents in cluster 0, each 10/3x as long
    balanced_docs = plan("uniform", [50, 50], [16_000, 500])  # even documents, tokens 32:1 against 10:1
    note = documents_not_tokens([balanced_docs])
    assert len(note) == 2 and note[1].startswith("uniform: drew clusters more evenly by documents than the corpus")
    assert "sampler=unimax" in note[1] and "unequal tokens" in note[1]
    assert documents_not_tokens([plan("unimax", [50, 50], [5_500, 5_500])]) == []  # even tokens: nothing to say
