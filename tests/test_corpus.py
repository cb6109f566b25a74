"""Corpus readers, validation errors and the held-out split."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ccexp.data.corpus import read_corpus, split_heldout
from ccexp.errors import CcexpError


def write_jsonl(path, records, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


RECORDS = [{"id": f"d{i}", "body": f"document number {i}", "domain": "a" if i % 3 else "b"} for i in range(30)]


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_reader_keeps_text_ids_and_labels(tmp_path, gz):
    path = write_jsonl(tmp_path / ("c.jsonl.gz" if gz else "c.jsonl"), RECORDS, gz)
    c = read_corpus(path, text_field="body", label_fields=["domain"])
    assert c.texts == [r["body"] for r in RECORDS]
    assert c.ids == [r["id"] for r in RECORDS]
    assert c.labels["domain"] == [r["domain"] for r in RECORDS]


def test_parquet_reader_matches_jsonl(tmp_path):
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "c.parquet")
    c = read_corpus(tmp_path / "c.parquet", text_field="body", label_fields=["domain"])
    assert c.texts == [r["body"] for r in RECORDS] and c.labels["domain"][0] == "b"


def test_missing_text_field_names_the_field_and_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", RECORDS)
    with pytest.raises(CcexpError, match=r"record 1 has no field 'text' .*set data.text_field"):
        read_corpus(path)


def test_missing_parquet_column_is_named(tmp_path):
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "c.parquet")
    with pytest.raises(CcexpError, match="has no column 'text'"):
        read_corpus(tmp_path / "c.parquet")


def test_non_utf8_line_is_reported_with_its_line_number(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(CcexpError, match=r"c.jsonl:2: not valid UTF-8"):
        read_corpus(path)


def test_invalid_json_is_reported_with_its_line_number(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(CcexpError, match=r"c.jsonl:2: not a JSON object"):
        read_corpus(path)


def test_empty_documents_are_dropped_or_rejected(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "a real one"}, {"text": "   "}, {"text": ""}])
    assert read_corpus(path).texts == ["a real one"]
    with pytest.raises(CcexpError, match="record 2 has an empty 'text'"):
        read_corpus(path, drop_empty=False)
    only_empty = write_jsonl(tmp_path / "e.jsonl", [{"text": ""}])
    with pytest.raises(CcexpError, match="no non-empty documents"):
        read_corpus(only_empty)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(CcexpError, match="does not exist"):
        read_corpus(tmp_path / "nope.jsonl")
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(CcexpError, match="cannot tell the format"):
        read_corpus(tmp_path / "c.txt")


def test_max_documents_is_a_deterministic_subsample(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", RECORDS)
    a = read_corpus(path, text_field="body", max_documents=10)
    b = read_corpus(path, text_field="body", max_documents=10)
    assert len(a) == 10 and a.ids == b.ids


def test_heldout_split_depends_only_on_document_ids():
    ids = [f"doc/{i}" for i in range(5000)]
    held = split_heldout(ids, 0.1)
    assert 0.08 < held.mean() < 0.12
    shuffled = np.random.default_rng(0).permutation(len(ids))
    held2 = split_heldout([ids[i] for i in shuffled], 0.1)
    assert np.array_equal(held2, held[shuffled])
    with pytest.raises(CcexpError):
        split_heldout(ids, 1.5)


def test_corrupt_gzip_lone_surrogate_and_folder_get_one_line_errors(tmp_path):
    good = write_jsonl(tmp_path / "c.jsonl.gz", RECORDS * 50, gz=True)
    data = bytearray(good.read_bytes())
    for k in range(len(data) // 2, len(data) // 2 + 50):
        data[k] ^= 0xFF
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(bytes(data))
    with pytest.raises(CcexpError, match="cannot be read|not a JSON object|not valid UTF-8"):
        read_corpus(bad, text_field="body")  # a CcexpError, whatever the flipped bytes break first
    sur = tmp_path / "s.jsonl"
    sur.write_text('{"text": "ok"}\n{"text": "bad \\ud800 here"}\n')
    with pytest.raises(CcexpError, match="record 2 .* lone surrogate"):
        read_corpus(sur)
    with pytest.raises(CcexpError, match="is a folder"):
        read_corpus(tmp_path)


def test_missing_label_values_get_a_visible_placeholder(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "a", "domain": "x"}, {"text": "b"}, {"text": "c", "domain": ""}])
    assert read_corpus(path, label_fields=["domain"]).labels["domain"] == ["x", "(none)", "(none)"]


def test_a_jsonl_file_that_starts_with_a_byte_order_mark_is_read(tmp_path):
    from ccexp.data.corpus import read_corpus

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "text": "first"}\n{"id": "b", "text": "second"}\n')
    corpus = read_corpus(path, format="auto", text_field="text", id_field="id")
    assert list(corpus.ids) == ["a", "b"] and list(corpus.texts) == ["first", "second"]


def test_a_long_text_tokenized_in_pieces_gives_the_same_ids(tmp_path):
    from ccexp.data.tokenize import encode_corpus, text_pieces, train_bpe_tokenizer

    words = ["alpha", "beta,", "gamma.", "  delta", "\nepsilon", "zeta's"]
    text = " ".join(words[i % 6] + str(i % 7) for i in range(30000))
    tok = train_bpe_tokenizer(iter([text[:5000]]), 400, tmp_path / "tok")
    pieces = text_pieces(text, limit=4096)
    assert len(pieces) > 10 and "".join(pieces) == text
    whole = tok(text, add_special_tokens=False)["input_ids"]
    tokens, offsets = encode_corpus(tok, [text, "short one"])
    assert tokens[: offsets[1]].tolist() == whole  # a byte-level BPE reads the pieces as it reads the whole


def test_a_label_field_of_fractional_numbers_is_read_but_warned_about(tmp_path, caplog):
    """A score per record given as a label field would make hundreds of one-document groups: the corpus is
    read (the values are labels as asked), with a warning naming the field and what to do instead."""
    import logging

    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}", "quality": i + 0.5, "domain": "ab"[i % 2]}) + "\n"
                            for i in range(1, 301)))
    with caplog.at_level(logging.WARNING, logger="ccexp"):
        c = read_corpus(path, label_fields=["domain", "quality"])
    assert len(set(c.labels["quality"])) == 300
    lines = [r.getMessage() for r in caplog.records if "label field" in r.getMessage()]
    assert len(lines) == 1 and "'quality' holds a fractional number in 300 of 300 records" in lines[0]
    assert "bin the numbers" in lines[0]
