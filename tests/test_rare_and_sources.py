"""Issue 34, items 2 and 3. A rare label value that the hash split holds out no document of is held out and
scored (``data.heldout_stratify=auto``, the default), or, with the plain hash split, named in the corpus line
and in the verdict. A source whose one giant document can move its share of the run's tokens past the stated
margin is warned of before any embedding, and ClusterClip's budget inside ``data.sources`` is refused before
the embedding too."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ccexp.data.corpus import heldout_flags, split_heldout
from conftest import run_ccexp
from test_cases import CASES, ccexp, one_line, runs

FRACTION = 0.05  # data.heldout_fraction's default


def rare_corpus(tmp_path: Path, n: int = 4) -> Path:
    """The cases' 300-document corpus plus ``n`` documents of domain 'rare' whose ids the hash split keeps all
    in training (chosen with the split itself)."""
    rows = [json.loads(line) for line in (CASES / "round4.jsonl").read_text().splitlines()]
    ids, i = [], 0
    while len(ids) < n:
        if not heldout_flags([f"rare{i}"], FRACTION)[0]:
            ids.append(f"rare{i}")
        i += 1
    text = rows[0]["text"]
    rows += [{"id": d, "text": f"Rare note {k}: " + text, "domain": "rare"} for k, d in enumerate(ids)]
    path = tmp_path / "rare.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not split_heldout([r["id"] for r in rows], FRACTION)[-n:].any()
    return path


def test_a_rare_label_value_is_held_out_and_scored_by_default(tmp_path):
    corpus = rare_corpus(tmp_path)
    proc = ccexp(tmp_path, "round4.jsonl", f"data.path={corpus}", "sampler=random", "train.steps=4")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    line = re.search(r"corpus: the hash split held out no document of domain (.*): held-out documents are stratified "
                     r"by domain \(data.heldout_stratify=auto", log)
    assert line and "'rare'" in line.group(1), log[-3000:]
    assert "no held-out document of" not in log  # every value is scored now
    _, (run,) = runs(tmp_path / "out")
    assert run.data.metrics["eval/heldout_docs_domain/rare"] == 2  # min(20, half of its 4 documents)
    assert np.isfinite(run.data.metrics["eval/ppl_domain/rare"])


def test_with_the_plain_hash_split_the_rare_value_is_named_in_the_corpus_line_and_the_verdict(tmp_path):
    corpus = rare_corpus(tmp_path)
    proc = ccexp(tmp_path, "round4.jsonl", "-m", f"data.path={corpus}", "data.heldout_stratify=null",
                 "sampler=random,uniform", "train.steps=4")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert re.search(r"corpus: no held-out document of domain [^:]*'rare'[^:]*: their held-out perplexity cannot be scored, "
                     r"and the report names them as not scored \(data.heldout_stratify=domain holds out", log), log[-3000:]
    report = next((tmp_path / "out" / "multirun").rglob("report/report.md")).read_text()
    verdict = report.split("### Signal")[0]
    line = next(ln for ln in verdict.splitlines() if ln.startswith("Not scored (no held-out document of the value in any "
                                                                   "run, so no perplexity): "))
    assert "ppl of domain = rare" in line, verdict


def sourced(tmp_path: Path, sources: str, *args: str):
    return run_ccexp("debug=tiny", "data=sources", sources, "data.label_fields=[source,domain]", "eval.max_tokens=63",
                     "logger=none", *args, f"paths.outputs={tmp_path / 'out'}", cwd=tmp_path, timeout=900)


def test_a_giant_document_in_a_source_is_warned_of_before_the_embedding(tmp_path):
    """data.sources at 70/30, one 30 % source document of ~12 % of the run's tokens (issue 34: 57.8/42.2 planned)."""
    rows = [json.loads(line) for line in (CASES / "round4.jsonl").read_text().splitlines()]
    web, code = tmp_path / "web.jsonl", tmp_path / "code.jsonl"
    web.write_text("".join(json.dumps(r) + "\n" for r in rows[:200]))
    giant = {"id": "giant", "text": " ".join(rows[250]["text"] for _ in range(60)), "domain": "code"}
    code.write_text("".join(json.dumps(r) + "\n" for r in rows[200:] + [giant]))
    sources = f"data.sources=[{{path: {web}, weight: 0.7, name: web}},{{path: {code}, weight: 0.3, name: code}}]"
    proc = sourced(tmp_path, sources, "sampler=random", "train.steps=40", "train.max_doc_tokens=null")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    line = re.search(r"data.sources: a document of source 'code' has ([\d,]+) tokens, ([\d.]+)% of the run's "
                     r"20,480 training tokens; a source's share can miss its target by up to that much", log)
    assert line and float(line.group(2)) > 1.0, log[-3000:]
    assert "train.max_doc_tokens=204" in log  # the cap that brings the bound within the 1 % margin
    assert log.index("data.sources: a document") < log.index("] - embed: ")  # before the embedding
    capped = sourced(tmp_path, sources, "sampler=random", "train.steps=40", "train.max_doc_tokens=200")
    assert capped.returncode == 0 and "data.sources: a document" not in capped.stdout + capped.stderr


def test_clusterclip_inside_sources_is_refused_before_the_embedding(tmp_path):
    """issue 34: with data=sources the ClusterClip budget was refused after 79 s of embedding."""
    rows = [json.loads(line) for line in (CASES / "round4.jsonl").read_text().splitlines()]
    web, code = tmp_path / "web.jsonl", tmp_path / "code.jsonl"
    web.write_text("".join(json.dumps(r) + "\n" for r in rows[:280]))
    code.write_text("".join(json.dumps(r) + "\n" for r in rows[280:]))
    sources = f"data.sources=[{{path: {web}, weight: 0.5, name: web}},{{path: {code}, weight: 0.5, name: code}}]"
    # the corpus as one could supply the budget (3 x ~7,800 tokens >= 10,240); the 20-document source cannot
    proc = sourced(tmp_path, sources, "sampler=clusterclip", "sampler.clip_threshold=3", "train.steps=20")
    line = one_line(proc, 2)
    assert re.search(r"data.sources: source code: sampler.clip_threshold=3 allows at most \d+ document draws", line), line
    assert "] - embed: " not in proc.stdout + proc.stderr and not (tmp_path / "out" / "cache" / "embed").exists()
