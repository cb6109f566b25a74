"""Corpora in object stores (``data.path=s3://...``), against a real S3-compatible server started here: moto in
server mode on a free local port, reached over HTTP by s3fs through ``AWS_ENDPOINT_URL`` — the reader, the checks
and the stage key are the real ones, nothing of them is mocked."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest

from conftest import run_ccexp

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

CASES = Path(__file__).parent / "cases"
BUCKET = "corpora"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A running S3-compatible server, the environment pointing at it (as a user's would at their store), and
    an s3fs filesystem on it with the bucket ``corpora``."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    os.environ.update(env)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _lines(n: int | None = None) -> bytes:
    lines = (CASES / "tiny.jsonl").read_bytes().splitlines(keepends=True)
    return b"".join(lines[:n])


def test_check_source_reads_an_s3_object_and_refuses_a_missing_one_in_one_line(s3):
    from ccexp.data.corpus import CorpusReader, check_source, read_corpus
    from ccexp.data.remote import RemoteSource
    from ccexp.errors import CcexpError

    s3.pipe(f"{BUCKET}/check/tiny.jsonl.gz", gzip.compress(_lines()))
    src, fmt = check_source(f"s3://{BUCKET}/check/tiny.jsonl.gz")
    assert isinstance(src, RemoteSource) and fmt == "jsonl" and str(src) == f"s3://{BUCKET}/check/tiny.jsonl.gz"
    local = read_corpus(CASES / "tiny.jsonl", label_fields=["domain"])
    remote = CorpusReader(f"s3://{BUCKET}/check/tiny.jsonl.gz", label_fields=["domain"]).read()
    assert remote.ids == local.ids and remote.texts == local.texts and remote.labels == local.labels

    for url in (f"s3://{BUCKET}/check/nope.jsonl", "s3://no-such-bucket/tiny.jsonl"):
        with pytest.raises(CcexpError) as e:
            check_source(url)
        assert str(e.value) == (f"data.path={url!r} does not exist; point data.path at a .jsonl, .jsonl.gz or "
                                ".parquet object, or a prefix holding them")
    with pytest.raises(CcexpError, match="cannot tell the format from the name"):
        s3.pipe(f"{BUCKET}/check/notes.txt", b"{}\n")
        check_source(f"s3://{BUCKET}/check/notes.txt")
    with pytest.raises(CcexpError, match="data.format=hf_disk reads a local datasets folder"):
        check_source(f"s3://{BUCKET}/check/tiny.jsonl.gz", "hf_disk")


def test_a_prefix_is_one_corpus_of_its_objects_in_sorted_order_and_parquet_streams_too(s3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ccexp.data.corpus import CorpusReader, read_corpus
    from ccexp.errors import CcexpError

    records = [json.loads(ln) for ln in _lines().splitlines()]
    s3.pipe(f"{BUCKET}/prefix/part-1.jsonl", _lines(100))
    s3.pipe(f"{BUCKET}/prefix/part-2.jsonl.gz", gzip.compress(b"".join(_lines().splitlines(keepends=True)[100:])))
    s3.pipe(f"{BUCKET}/prefix/README.md", b"not a corpus object")
    local = read_corpus(CASES / "tiny.jsonl", label_fields=["domain"])
    whole = CorpusReader(f"s3://{BUCKET}/prefix/", label_fields=["domain"]).read()
    assert whole.ids == local.ids and whole.texts == local.texts

    table = pa.Table.from_pylist(records)
    with s3.open(f"{BUCKET}/pq/tiny.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=64)  # several row groups, read batch by batch
    parquet = CorpusReader(f"s3://{BUCKET}/pq/tiny.parquet", label_fields=["domain"]).read()
    assert parquet.ids == local.ids and parquet.texts == local.texts and parquet.labels == local.labels

    s3.pipe(f"{BUCKET}/pq/more.jsonl", _lines(5))
    with pytest.raises(CcexpError) as e:
        CorpusReader(f"s3://{BUCKET}/pq")
    assert str(e.value) == (f"data.path='s3://{BUCKET}/pq' holds both .jsonl and .parquet objects; set "
                            "data.format=jsonl or data.format=parquet to read one kind")
    assert len(CorpusReader(f"s3://{BUCKET}/pq", format="jsonl").read()) == 5
    s3.pipe(f"{BUCKET}/docs/README.md", b"no corpus here")
    with pytest.raises(CcexpError) as e:
        CorpusReader(f"s3://{BUCKET}/docs")
    assert str(e.value) == (f"data.path='s3://{BUCKET}/docs' is a prefix without .jsonl(.gz) or .parquet objects; "
                            "point data.path at one object, or a prefix holding them")


def test_the_corpus_key_follows_the_objects_etag_not_a_reread(s3):
    from ccexp import stage_keys as keys
    from ccexp.data.corpus import check_source

    url = f"s3://{BUCKET}/key/tiny.jsonl"
    s3.pipe(url, _lines(200))
    src, _ = check_source(url)
    first = src.identity()
    assert first[0]["name"] == url and first[0]["size"] == len(_lines(200)) and first[0]["ETag"]
    assert keys.object_digest(src.identity()) == keys.object_digest(first)  # unchanged: the same key
    s3.pipe(url, _lines(200))  # the same bytes written again: the same ETag
    assert keys.object_digest(src.identity()) == keys.object_digest(first)
    s3.pipe(url, _lines(199) + _lines()[len(_lines(199)):len(_lines(200))].replace(b"d0199", b"x0199"))
    assert keys.object_digest(src.identity()) != keys.object_digest(first)  # same size, new content: a new key


def test_refused_credentials_and_a_missing_filesystem_package_are_one_line(s3):
    import requests

    from ccexp.data.corpus import check_source
    from ccexp.errors import CcexpError

    s3.pipe(f"{BUCKET}/auth/tiny.jsonl", _lines(10))
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0")  # the server now checks keys: "testing" is unknown
    try:
        with pytest.raises(CcexpError) as e:
            check_source(f"s3://{BUCKET}/auth/tiny.jsonl")
    finally:
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf")
    assert str(e.value) == ("data.path='s3://corpora/auth/tiny.jsonl': access denied (Forbidden); check the "
                            "credentials and endpoint in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                            "or AWS_PROFILE; AWS_ENDPOINT_URL for an S3-compatible server)")

    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(CcexpError) as e:
            check_source("gs://bucket/corpus.jsonl")
        assert str(e.value) == ("data.path='gs://bucket/corpus.jsonl' needs the gcsfs package to read gs:// URLs; "
                                "pip install gcsfs")
    with pytest.raises(CcexpError) as e:
        check_source("nope://bucket/corpus.jsonl")
    assert str(e.value) == ("data.path='nope://bucket/corpus.jsonl': nope:// is not a filesystem fsspec knows "
                            "(Protocol not known: nope); use s3://, gs://, hf://, az://, https:// or a local path")


TINY = ["debug=tiny", "data=jsonl", "data.label_fields=[domain]", "train.max_doc_tokens=64", "eval.max_tokens=63",
        "train.steps=5"]


def _corpus_line(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "[ccexp][INFO] - corpus: " in ln
             and " docs (" in ln]  # the corpus line itself (a stratified split adds its own line before it)
    assert len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]
    return lines[0]


@pytest.mark.slow
def test_an_s3_corpus_runs_end_to_end_is_reused_unchanged_and_reread_when_its_object_changes(s3, tmp_path):
    from mlflow import MlflowClient

    url = f"s3://{BUCKET}/e2e/tiny.jsonl.gz"
    s3.pipe(url, gzip.compress(_lines(200)))
    out = tmp_path / "out"
    args = [*TINY, f"data.path={url}", f"paths.outputs={out}"]

    first = _corpus_line(run_ccexp(*args, cwd=tmp_path))
    assert "200 docs" in first and "from tiny.jsonl.gz, reused=False" in first
    proc = run_ccexp(*args, cwd=tmp_path)
    again = _corpus_line(proc)
    assert "200 docs" in again and "reused=True" in again
    second = proc.stdout + proc.stderr
    assert "nothing to do" in second  # the same corpus, finished: not trained again

    s3.pipe(url, gzip.compress(_lines()))  # the object changes: a new ETag
    proc = run_ccexp(*args, cwd=tmp_path)
    changed = _corpus_line(proc)
    assert "300 docs" in changed and "reused=False" in changed
    assert "on another corpus" in proc.stdout + proc.stderr and "nothing to do" not in proc.stdout + proc.stderr

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp")
    rs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    assert len(rs) == 2 and all(r.info.status == "FINISHED" for r in rs)  # the first corpus and the changed one
    assert all(r.data.metrics.get("eval/ppl", 0) > 1 for r in rs)  # held-out figures, from the stored corpus
    assert f"held-out ppl {rs[0].data.metrics['eval/ppl']:.2f}" in second  # the finished run's figures, reported
    assert len(list((out / "cache" / "corpus").iterdir())) == 2



def test_a_missing_s3_object_stops_the_cli_before_any_stage_in_one_line(s3, tmp_path):
    proc = run_ccexp(*TINY, f"data.path=s3://{BUCKET}/cli/nope.jsonl", f"paths.outputs={tmp_path / 'out'}",
                     cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("ccexp:")] == [
        f"ccexp: error: data.path='s3://{BUCKET}/cli/nope.jsonl' does not exist; point data.path at a .jsonl, "
        ".jsonl.gz or .parquet object, or a prefix holding them"]


def test_a_server_that_cannot_be_reached_is_one_line():
    """A filesystem that connects when it is made (ftp://) and finds nobody there: one line, not a traceback."""
    from ccexp.data.corpus import check_source
    from ccexp.errors import CcexpError

    with pytest.raises(CcexpError, match=r"cannot reach the ftp:// server"):
        check_source("ftp://127.0.0.1:9/x.jsonl")
