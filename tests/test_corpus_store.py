"""The streamed corpus: a Hugging Face datasets folder as input, the corpus stage's Parquet shards read
on demand, and sharded, resumable tokenization equal to tokenizing the whole corpus at once."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from ccexp.__main__ import CONFIG_DIR
from ccexp.artifacts import StageStore
from ccexp.data.corpus import CorpusReader, read_corpus, split_heldout, take
from ccexp.data.store import open_corpus, write_corpus
from ccexp.data.tokenize import assemble_tokens, encode_corpus, tokenize_shards
from ccexp.errors import CcexpError
from ccexp.stages import Stages


def stages_for(tmp_path: Path, *overrides: str) -> Stages:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("config", overrides=[f"paths.outputs={tmp_path}", "model.tokenizer.vocab_size=400", *overrides])
    stages = Stages.for_config(cfg, StageStore(Path(cfg.paths.cache)))
    stages.cfg = cfg  # for the tests that read the composed config back (the stages keep only their parts)
    return stages


def test_datasets_folder_reads_like_the_jsonl_file(tmp_path, small_corpus, caplog):
    import datasets

    plain = read_corpus(small_corpus, label_fields=["domain"])
    ds = datasets.Dataset.from_dict({"id": list(plain.ids), "text": list(plain.texts), "domain": plain.labels["domain"]})
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    c = read_corpus(tmp_path / "dd", label_fields=["domain"])  # format auto: a datasets folder
    assert c.ids == plain.ids and c.texts == plain.texts and c.labels == plain.labels
    assert len(read_corpus(tmp_path / "dd", split="test")) == 3
    with pytest.raises(CcexpError, match=r"has splits \['test', 'train'\], not data.split='valid'"):
        read_corpus(tmp_path / "dd", split="valid")
    with pytest.raises(CcexpError, match="has no column 'body'"):
        read_corpus(tmp_path / "dd", text_field="body")
    ds.select([]).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(CcexpError, match="not a readable datasets folder, or one without rows"):
        read_corpus(tmp_path / "empty")
    ds.save_to_disk(str(tmp_path / "one"))
    with caplog.at_level("WARNING", logger="ccexp"):
        assert len(read_corpus(tmp_path / "one", split="test")) == len(plain)
    assert "holds one dataset, not a DatasetDict with splits; data.split=test is ignored" in caplog.text
    datasets.Dataset.from_dict({"text": ["fine", None]}).save_to_disk(str(tmp_path / "null"))
    with pytest.raises(CcexpError, match="record 2 field 'text' is null; give every record a text"):
        read_corpus(tmp_path / "null")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CcexpError, match="is a folder; point data.path at one .jsonl"):
        read_corpus(tmp_path / "plain")
    with pytest.raises(CcexpError, match="data.format=hf_disk needs a datasets folder"):
        read_corpus(small_corpus, format="hf_disk")


def test_shards_keep_every_document_and_read_back_in_any_order(tmp_path, small_corpus):
    plain = read_corpus(small_corpus, label_fields=["domain"])
    one, many = tmp_path / "one", tmp_path / "many"
    one.mkdir(), many.mkdir()
    reader = CorpusReader(small_corpus, label_fields=["domain"])
    f1 = write_corpus(reader.batches(100_000), one, heldout_fraction=0.1, label_fields=["domain"])
    f7 = write_corpus(reader.batches(7), many, heldout_fraction=0.1, label_fields=["domain"])
    assert f7["shards"] == -(-len(plain) // 7) and f1["shards"] == 1
    assert f1["content"] == f7["content"] and f1["heldout"] == f7["heldout"]  # the same corpus, however sharded
    c = open_corpus(many)
    assert len(c) == len(plain) and list(c.texts) == plain.texts and c.ids == plain.ids
    assert np.array_equal(c.heldout, split_heldout(plain.ids, 0.1))
    docs = np.random.default_rng(0).permutation(len(plain))[:50]
    assert take(c.texts, docs) == [plain.texts[d] for d in docs]
    assert take(c.labels["domain"], docs) == [plain.labels["domain"][d] for d in docs]
    assert c.texts[5:19] == plain.texts[5:19] and c.texts[-1] == plain.texts[-1]
    with pytest.raises(IndexError):
        c.texts[len(plain)]


def test_sharded_tokenization_equals_whole_corpus_tokenization_and_resumes(tmp_path, small_corpus):
    st = stages_for(tmp_path / "a", "data=jsonl", f"data.path={small_corpus}", "data.shard_documents=23")
    corpus = st.corpus()
    tokenized = st.tokenize(corpus)
    assert st.results["corpus"].figures["shards"] == -(-len(corpus) // 23)
    whole_tokens, whole_offsets = encode_corpus(tokenized.tokenizer, list(corpus.texts))
    assert np.array_equal(tokenized.offsets, whole_offsets) and np.array_equal(tokenized.tokens, whole_tokens)
    assert tokenized.tokens.dtype == np.int32 and isinstance(tokenized.tokens, np.memmap)
    # a run killed after some shards: the rerun tokenizes only the others, to the same arrays
    work = tmp_path / "work"
    first = tokenize_shards(tokenized.tokenizer, corpus.texts, None, work, shard_documents=23, rank=0, world_size=3)
    again = tokenize_shards(tokenized.tokenizer, corpus.texts, None, work, shard_documents=23)
    assert again["skipped"] == first["tokenized"] and sorted(again["tokenized"] + first["tokenized"]) == list(
        range(-(-len(corpus) // 23)))
    # shards of another size in the same folder are not taken for finished ones
    other_size = tokenize_shards(tokenized.tokenizer, corpus.texts, None, work, shard_documents=40)
    assert other_size["skipped"] == [] and len(other_size["tokenized"]) == -(-len(corpus) // 40)
    out = tmp_path / "assembled"
    out.mkdir()
    assert assemble_tokens(work, len(corpus), 40, out)["tokens"] == whole_tokens.size
    assert np.array_equal(np.load(out / "tokens.npy"), whole_tokens)
    # another shard size: the same corpus content, hence the same tokenize stage output reused
    other = stages_for(tmp_path / "a", "data=jsonl", f"data.path={small_corpus}", "data.shard_documents=1000")
    other.tokenize(other.corpus())
    assert other.results["tokenize"].reused and other.results["tokenize"].fingerprint == st.results["tokenize"].fingerprint


RANK_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pathlib import Path
from hydra import compose, initialize_config_dir
from ccexp.__main__ import CONFIG_DIR
from ccexp.artifacts import StageStore
from ccexp.stages import Stages
with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
    cfg = compose("config", overrides=sys.argv[1:])
st = Stages.for_config(cfg, StageStore(Path(cfg.paths.cache)))
t = st.tokenize(st.corpus())
print("RESULT", int(t.offsets[-1]), st.results["tokenize"].reused, st.results["corpus"].reused)
"""


@pytest.mark.slow
def test_two_ranks_tokenize_their_shards_and_compute_each_stage_once(tmp_path, small_corpus):
    args = [f"paths.outputs={tmp_path}", "model.tokenizer.vocab_size=400", "data=jsonl", f"data.path={small_corpus}",
            "data.shard_documents=20"]
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"}) for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:] + outs[1][1][-2000:]
    results = [next(line.split()[1:] for line in out.splitlines() if line.startswith("RESULT")) for out, _ in outs]
    assert results[0][1] == "False" and results[1][1] == "True"  # rank 0 published, rank 1 loaded it
    assert sorted(r[2] for r in results) == ["False", "True"]  # the corpus stage: one rank read it, the other waited
    assert results[0][0] == results[1][0]
    shards = -(-len(read_corpus(small_corpus)) // 20)
    logs = outs[1][1]
    assert f"tokenize: shard {shards // 2}/{shards // 2} (rank 1)" in logs  # rank 1 did its half
    assert f"tokenize: shard {-(-shards // 2)}/{-(-shards // 2)} (rank 0)" in outs[0][1]  # and rank 0 only its own
    single = stages_for(tmp_path / "single", "data=jsonl", f"data.path={small_corpus}")
    assert int(single.tokenize(single.corpus()).offsets[-1]) == int(results[0][0])
