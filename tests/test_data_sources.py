"""data=sources: several corpora read as one, each document labelled with its source, and the run's sampler
inside each source at the target token shares (ccexp.data.sources, ccexp.sampling.sources)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ccexp.data.corpus import CorpusReader
from ccexp.data.sources import SOURCE_FIELD, source_batches, source_mix, source_names, source_weights
from ccexp.errors import CcexpError
from warm import python_m
from conftest import run_ccexp
from test_cases import CASES, TINY


def split_by_domain(tmp_path: Path) -> tuple[Path, Path, int]:
    """tests/cases/tiny.jsonl cut in two files by domain (the first two domains, the rest); its documents' count."""
    records = [json.loads(line) for line in (CASES / "tiny.jsonl").read_text().splitlines()]
    first = sorted({r["domain"] for r in records})[:2]
    a, b = tmp_path / "news.jsonl", tmp_path / "other.jsonl.gz"
    a.write_text("".join(json.dumps(r) + "\n" for r in records if r["domain"] in first))
    import gzip

    with gzip.open(b, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records if r["domain"] not in first)
    return a, b, len(records)


def test_sources_read_as_one_corpus_labelled_by_source_with_distinct_ids(tmp_path):
    a, b, n = split_by_domain(tmp_path)
    names = source_names([{"path": str(a)}, {"path": str(b), "name": None}])
    assert names == ["news", "other"]
    readers = [(name, CorpusReader(p, label_fields=["domain"]).batches) for name, p in zip(names, (a, b))]
    batches = list(source_batches(readers, 64))
    assert [len(x.texts) for x in batches[:-1]] == [64] * (len(batches) - 1)  # one shard size across sources
    ids = [i for x in batches for i in x.ids]
    labels = [v for x in batches for v in x.labels[SOURCE_FIELD]]
    assert len(ids) == n == len(set(ids)) and ids[0].startswith("news/") and ids[-1].startswith("other/")
    assert labels == sorted(labels) and set(labels) == {"news", "other"}
    assert all(len(x.labels["domain"]) == len(x.texts) for x in batches)


@pytest.mark.parametrize("sources,line", [
    ([{"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl"}], "give a weight for every source or for none"),
    ([{"path": "a.jsonl", "weight": -1}, {"path": "b.jsonl", "weight": 1}], "must be finite, >= 0 and not all 0"),
    ([{"path": "a.jsonl", "weight": 0}, {"path": "b.jsonl", "weight": 0}], "must be finite, >= 0 and not all 0"),
    ([{"path": "a.jsonl", "weight": "x"}, {"path": "b.jsonl", "weight": 1}], "must be numbers"),
    ([{"path": "x/a.jsonl"}, {"path": "y/a.jsonl.gz"}], "two sources are named 'a'"),
    ([{"weight": 1}], "data.sources[0] has no path"),
    ([{"path": "a.jsonl", "name": "web/x"}], "data.sources[0] is named 'web/x'; a source name may not hold '/'"),
    ([{"path": "a.jsonl", "weight": True}, {"path": "b.jsonl", "weight": 1}], "must be numbers"),
])
def test_bad_sources_are_one_line(sources, line):
    with pytest.raises(CcexpError, match=re.escape(line)):
        source_names(sources)
        source_weights(sources)


def test_the_mix_maps_each_document_to_its_source_and_normalises_the_shares():
    from omegaconf import OmegaConf

    data = OmegaConf.create({"sources": [{"path": "web.jsonl", "weight": 7}, {"path": "code.jsonl", "weight": 3}]})
    ids, weights, names = source_mix(data, {SOURCE_FIELD: ["code", "web", "web"]})
    assert ids.tolist() == [1, 0, 0] and np.allclose(weights, [0.7, 0.3]) and names == ["web", "code"]
    assert source_mix(OmegaConf.create({"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl"}]}), {}) is None


@pytest.mark.parametrize("args,line", [
    (["data=sources"], "data=sources needs data.sources=[{path: ..., weight: ...}, ...]"),
    (["data=jsonl", "data.path=x.jsonl", "data.sources=[{path: a.jsonl}]"], "data.sources are read with data=sources"),
    (["data=sources", "data.sources=[{path: /nope/a.jsonl, weight: 1}]"], "data.sources[0].path='/nope/a.jsonl' does "
                                                                          "not exist"),
    (["data=sources", "data.sources=[{path: a.jsonl, wieght: 1}]"], "data.sources[0].wieght is not a setting of a "
                                                                    "source; did you mean 'weight'?"),
    (["data=sources", "data.sources=[{path: a.jsonl}]", "data.label_fields=[domain]"],
     "data.label_fields=['domain'] lacks 'source'"),
])
def test_the_command_line_refuses_bad_sources_in_one_line_before_any_stage(args, line, tmp_path):
    proc = run_ccexp(*args, f"paths.outputs={tmp_path}", cwd=tmp_path)
    assert proc.returncode != 0 and line in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_target_token_shares_hold_to_the_token_in_a_plan_and_a_run_reports_per_source(tmp_path):
    """70/30 over two sources with ClusterClip inside each: the plan's tokens per source are within one
    document of the target shares; a training run on the same config has held-out figures per source."""
    a, b, _ = split_by_domain(tmp_path)
    common = [*TINY, "data=sources", f"data.sources=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]",
              "data.label_fields=[source,domain]", f"paths.outputs={tmp_path / 'out'}", "sampler=clusterclip",
              "sampler.on_exhausted=reset", "train.steps=30", "eval.every_n_steps=null"]
    plan = python_m("ccexp.plan", *common, cwd=tmp_path, timeout=900)
    assert plan.returncode == 0, plan.stderr[-3000:]
    (folder,) = (tmp_path / "out").glob("plans/*/*")
    rows = re.findall(r"\| \S+ \| (news|other) \| ([\d.]+)% \| ([\d.]+)% \| ([\d,]+) \| ([+-][\d,]+) \|",
                      (folder / "plan.md").read_text())
    assert [r[0] for r in rows] == ["news", "other"]
    tokens = {r[0]: int(r[3].replace(",", "")) for r in rows}
    total = sum(tokens.values())
    assert total == 30 * 512
    longest = 64 + 1  # train.max_doc_tokens (TINY) plus the separator: the longest document in the stream
    assert abs(tokens["news"] - 0.7 * total) <= longest and abs(tokens["other"] - 0.3 * total) <= longest
    run = run_ccexp(*common, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sources: target token shares news 70.0 %" in run.stdout + run.stderr
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    (r,) = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])
    assert {"eval/ppl_source/news", "eval/ppl_source/other"} <= set(r.data.metrics)


def test_a_sampler_that_reads_similarity_is_refused_inside_sources():
    from ccexp.config import compose
    from ccexp.training.runner import sampler_over

    cfg = compose(["sampler=cluster_dp", "clusterer.k=2"])
    labels = np.array([0, 1, 0, 1], dtype=np.int32)
    with pytest.raises(CcexpError, match=re.escape("sampler=cluster_dp cannot run inside data.sources")):
        sampler_over(cfg.sampler, cfg.train, labels, np.array([2, 2]), np.full(4, 50),
                     sources=(np.array([0, 0, 1, 1]), np.array([0.5, 0.5]), ["a", "b"]))
    cfg = compose(["sampler=clusterclip", "sampler.on_exhausted=reset"])
    mixed = sampler_over(cfg.sampler, cfg.train, labels, np.array([2, 2]), np.full(4, 50),
                         sources=(np.array([0, 0, 1, 1]), np.array([0.5, 0.5]), ["a", "b"]))
    assert type(mixed).__name__ == "SourceMixture" and "clusterclip inside each source" in mixed.notes()[0][1]
