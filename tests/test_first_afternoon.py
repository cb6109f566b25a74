"""A researcher's first afternoon (issue 21): labels are never dropped silently, budgets are checked before the
embedding is paid for, a comma-list plan keeps the variants that can run, and bad input answers early."""
from __future__ import annotations

import gzip
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ccexp.errors import CcexpError
from warm import python_m
from conftest import ROOT, run_ccexp
from test_cases import CASES, TINY
from test_config_and_cli import one_error_line
from test_corpus_store import stages_for


def write_records(path: Path, records: list[dict]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def test_the_labels_line_names_each_label_field_and_its_values(tmp_path, small_corpus, caplog):
    caplog.set_level(logging.INFO, logger="ccexp")
    st = stages_for(tmp_path, "data=jsonl", f"data.path={small_corpus}", "data.label_fields=[domain]")
    domains = {json.loads(line)["domain"] for line in gzip.open(small_corpus, "rt")}
    st.corpus()
    assert f"labels: domain ({len(domains)} values)" in caplog.text


def test_no_labels_is_said_with_a_hint_naming_the_field_that_looks_like_one(tmp_path, small_corpus, caplog):
    caplog.set_level(logging.INFO, logger="ccexp")
    st = stages_for(tmp_path, "data=jsonl", f"data.path={small_corpus}", "data.label_fields=[]")
    st.corpus()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("labels:")]
    assert line.startswith("labels: none; the records carry 'domain'") and "data.label_fields=[domain]" in line


def test_a_label_field_no_record_has_is_an_error_with_the_field_it_likely_meant(small_corpus):
    from ccexp.data.corpus import read_corpus

    with pytest.raises(CcexpError, match=r"no record of .* has a field 'domian'; did you mean 'domain'\?"):
        read_corpus(small_corpus, label_fields=["domian"])


def test_a_label_field_most_records_lack_is_a_warning_and_those_records_count_as_none(tmp_path, caplog):
    from ccexp.data.corpus import read_corpus

    records = [{"id": str(i), "text": f"document number {i} " * 5, **({"domain": "a"} if i < 3 else {})}
               for i in range(10)]
    corpus = read_corpus(write_records(tmp_path / "c.jsonl.gz", records), label_fields=["domain"])
    assert "label field 'domain' is missing or empty in 7 of 10 records" in caplog.text
    assert list(corpus.labels["domain"]).count("(none)") == 7


def test_the_budget_in_passes_becomes_steps_over_the_training_tokens(tmp_path, small_corpus):
    from ccexp.data.packing import stream_lengths
    from ccexp.training.runner import settle_budget

    st = stages_for(tmp_path, "data=jsonl", f"data.path={small_corpus}", "train.passes=2.5", "train.tokens_per_step=512",
                    "train.micro_batch_size=8", "train.seq_len=64")
    corpus = st.corpus()
    tokenized = st.tokenize(corpus)
    settle_budget(st.cfg.train, st.cfg.sampler, tokenized, ~corpus.heldout)
    total = int(stream_lengths(tokenized.lengths(np.flatnonzero(~corpus.heldout)), st.cfg.train.max_doc_tokens).sum())
    assert st.cfg.train.steps == int(np.ceil(2.5 * total / 512))
    capped = stages_for(tmp_path, "data=jsonl", f"data.path={small_corpus}", "train.passes=2.5", "train.max_steps=7",
                        "train.tokens_per_step=512", "train.micro_batch_size=8", "train.seq_len=64")
    settle_budget(capped.cfg.train, capped.cfg.sampler, tokenized, ~corpus.heldout)
    assert capped.cfg.train.steps == 7


def test_a_budget_the_data_cannot_supply_is_refused_before_the_embed_stage(tmp_path):
    proc = run_ccexp(*TINY, f"data.path={CASES / 'tiny.jsonl'}", f"paths.outputs={tmp_path}", "sampler=clusterclip",
                     "sampler.clip_threshold=1", "train.steps=5000", cwd=tmp_path)
    line = one_error_line(proc)
    assert "clip" in line and "train.steps" in line, line
    assert "tokenize:" in proc.stdout + proc.stderr or (tmp_path / "cache" / "tokenize").exists()
    assert not list(tmp_path.rglob("embeddings*.npy")) and "embed:" not in proc.stdout  # nothing was embedded


def test_a_plan_writes_the_variants_that_can_run_and_marks_the_ones_that_cannot(tmp_path):
    args = [*TINY, f"data.path={CASES / 'tiny.jsonl'}", f"paths.outputs={tmp_path}", "sampler=random,clusterclip_m2",
            "train.steps=5000", "embedder.shard_size=50"]
    proc = python_m("ccexp.plan", *args, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 of 2 variants cannot run" in proc.stdout
    (folder,) = tmp_path.glob("plans/*/*")
    table = (folder / "plan.md").read_text()
    assert "| sampler=random |" in table and "| sampler=clusterclip_m2 | cannot run:" in table
    assert (folder / "plan.png").is_file()


def test_a_missing_corpus_path_is_answered_before_torch_is_imported(tmp_path):
    code = ("import sys, runpy; sys.argv = ['ccexp', 'data=jsonl', 'data.path=/nowhere/c.jsonl', "
            f"'paths.outputs={tmp_path}']\n"
            "try:\n    runpy.run_module('ccexp', run_name='__main__')\n"
            "except SystemExit as e:\n    print('EXIT', e.code, 'torch' in sys.modules, 'lightning' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "EXIT 2 False False" in proc.stdout, proc.stdout + proc.stderr
    assert "data.path='/nowhere/c.jsonl' does not exist" in proc.stderr
