"""Round 4's object-store cases (``shared/cases/round4``), each the kind of fault it stands for, against a real
S3-compatible server (moto in server mode on a free local port, as in ``tests/test_object_store.py``):

- c22: a JSON-lines object was read quadratically (fsspec's ``readline`` reads a whole block and seeks back, so
  every line copied up to 50 MiB). Every reader of an object — ``.jsonl``, ``.jsonl.gz``, ``.parquet``, a prefix of
  several objects — now reads it in a few large reads: the bytes it copies out of the read-ahead and the bytes it
  asks of the server are counted and held to about the object's size (no wall-clock limit), and its corpus is the
  local file's.
- c21: the server going away mid-read was a botocore traceback. Whatever reads the object, it is now one line
  naming the setting, the URL and how far the read got, exit 2, and no corpus stage is published. The server is
  stopped by a proxy in front of it, at the first request after the object's first ranged GET (as the case stops
  moto after that GET), so the point of failure does not depend on timing.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import random
import re
import socket
import threading
from pathlib import Path

import pytest

from conftest import ROOT, run_ccexp
from test_object_store import BUCKET, CASES, _free_port

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

ERRORS_MD = ROOT / "docs" / "errors.md"
TINY = ["debug=tiny", "data.label_fields=[domain]", "train.max_doc_tokens=64", "eval.max_tokens=63", "train.steps=2",
        "logger=none"]


@pytest.fixture(scope="module")
def s3():
    """A running S3-compatible server with the bucket ``corpora``, the environment pointing at it, and an s3fs
    filesystem on it (as ``tests/test_object_store.py``'s; moto's state is reset and fsspec's cached filesystems
    dropped at the end, since every moto server of a process shares the one and the other names this server)."""
    import requests

    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    os.environ.update(env)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec's cached filesystems point at another module's server
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        requests.post(f"{env['AWS_ENDPOINT_URL']}/moto-api/reset")
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def documented(line: str) -> str:
    """The row of docs/errors.md that shows ``line`` (its ``...`` any text, its ``<url>`` / ``<object>`` any
    name, its numbers any numbers)."""
    for row in ERRORS_MD.read_text().splitlines():
        for shown in re.findall(r"`([^`]+)`", row):
            pattern = "".join(r"\d[\d,.]*" if re.fullmatch(r"\d[\d,.]*", part) else ".*" if part == "..." else
                              r"\S+?" if re.fullmatch(r"<\w+>", part) else re.escape(part)
                              for part in re.split(r"(\.\.\.|<\w+>|\d[\d,.]*)", shown))
            if len(shown) > 40 and re.fullmatch(pattern, line):
                return row
    raise AssertionError(f"no row of docs/errors.md shows {line!r}")


# -- c22: reading an object is linear in its size ------------------------------------------------------------
def _many(n: int) -> bytes:
    """``n`` short documents: tiny.jsonl's repeated, each with its own id (as the case's 200,000)."""
    docs = [json.loads(ln) for ln in (CASES / "tiny.jsonl").read_bytes().splitlines()]
    return b"".join(json.dumps({**docs[i % len(docs)], "id": f"m{i}"}).encode() + b"\n" for i in range(n))


class ReadCounter:
    """What the object's fsspec files were asked for: ``copied`` bytes returned by their reads (out of the
    read-ahead), in ``reads`` calls that returned bytes (not those at the end), and ``fetched`` bytes requested from
    the server (ranged GETs)."""

    def __init__(self, monkeypatch):
        import fsspec.spec
        import s3fs.core

        self.copied = self.reads = self.fetched = 0
        read, fetch = fsspec.spec.AbstractBufferedFile.read, s3fs.core.S3File._fetch_range

        def counted_read(f, length=-1):
            out = read(f, length)
            self.copied, self.reads = self.copied + len(out), self.reads + bool(out)
            return out

        def counted_fetch(f, start, end):
            out = fetch(f, start, end)
            self.fetched += len(out)
            return out

        monkeypatch.setattr(fsspec.spec.AbstractBufferedFile, "read", counted_read)
        monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counted_fetch)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet", "prefix", "jsonl, 64 KiB blocks"])
def test_c22_every_object_reader_reads_about_the_objects_size_and_gives_the_local_corpus(s3, tmp_path, monkeypatch,
                                                                                          kind):
    """3,000 short documents (590 KB): the quadratic reader copied ~1 GB out of the read-ahead in 3,000 reads (one
    per line); now the bytes copied and fetched are the object's size, give or take the Parquet footer."""
    import fsspec.config
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ccexp.data import remote as remote_module
    from ccexp.data.corpus import CorpusReader, read_corpus
    from ccexp.data.store import write_corpus

    data = _many(3000)
    local = tmp_path / "many.jsonl"
    local.write_bytes(data)
    url = f"s3://{BUCKET}/c22/{kind.split(',')[0]}/"
    if kind == "prefix":  # one corpus of three objects, plain and gzip
        lines = data.splitlines(keepends=True)
        s3.pipe(url + "part-1.jsonl", b"".join(lines[:1000]))
        s3.pipe(url + "part-2.jsonl.gz", gzip.compress(b"".join(lines[1000:2000])))
        s3.pipe(url + "part-3.jsonl", b"".join(lines[2000:]))
    elif kind == "parquet":
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([json.loads(ln) for ln in data.splitlines()]), buf, row_group_size=500)
        url += "many.parquet"
        s3.pipe(url, buf.getvalue())
    else:
        url += "many.jsonl.gz" if kind == "jsonl.gz" else "many.jsonl"
        s3.pipe(url, gzip.compress(data) if kind == "jsonl.gz" else data)
    read_size = 1 << 20  # ccexp.data.remote.READ_BUFFER
    if "64 KiB" in kind:  # many read-ahead blocks (fsspec's configuration: FSSPEC_S3_DEFAULT_BLOCK_SIZE) of 16 KiB reads
        read_size = 1 << 14
        monkeypatch.setitem(fsspec.config.conf, "s3", {"default_block_size": 1 << 16})
        monkeypatch.setattr(remote_module, "READ_BUFFER", read_size, raising=False)
    sizes = [s3.size(p) for p in (s3.find(url) if kind == "prefix" else [url])]
    size = sum(sizes)

    counter = ReadCounter(monkeypatch)
    remote = CorpusReader(url, label_fields=["domain"]).read()
    # a few large reads per object (3,000 lines: the quadratic reader made one per line, each up to a block)
    assert counter.reads <= sum(n // read_size + 3 for n in sizes), (counter.reads, counter.copied, size)
    bound = 2 * size if kind == "parquet" else size  # pyarrow reads the footer's last 64 KiB again
    assert counter.copied <= bound and counter.fetched <= bound, (counter.copied, counter.fetched, size)
    assert counter.fetched >= size * (0.5 if kind == "parquet" else 1)  # every byte came from the server

    whole = read_corpus(local, label_fields=["domain"])
    assert remote.ids == whole.ids and remote.texts == whole.texts and remote.labels == whole.labels
    if kind == "jsonl":  # and the corpus stage's shards are the local file's, digest for digest
        figures = []
        for src, name in ((url, "remote"), (local, "local")):
            (tmp_path / name).mkdir()
            figures.append(write_corpus(CorpusReader(src, label_fields=["domain"]).batches(1000), tmp_path / name,
                                        heldout_fraction=0.05, label_fields=["domain"]))
        assert figures[0]["documents"] == 3000 and figures[0]["content"] == figures[1]["content"]
        assert figures[0]["labels"] == figures[1]["labels"]


# -- c21: the server goes away mid-read ----------------------------------------------------------------------
class StoppingProxy:
    """A TCP proxy in front of the S3 server that stops — closes its port and every connection, as a server that
    goes away — at the first request after ``ranged`` ranged GETs of a key under ``prefix`` (the request is not
    passed on)."""

    def __init__(self, upstream: int, prefix: str, ranged: int = 1):
        self.upstream, self.prefix, self.ranged = upstream, prefix.encode(), ranged
        self.gets, self.stopped, self.lock, self.conns = 0, threading.Event(), threading.Lock(), []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self):
        while not self.stopped.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            with self.lock:
                self.conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool):
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            if requests and re.match(rb"[A-Z]+ /", data):
                with self.lock:
                    if self.gets >= self.ranged:
                        self.stop()
                        break
                    head = data.split(b"\r\n\r\n", 1)[0]
                    if head.startswith(b"GET /" + self.prefix) and re.search(rb"\r\nrange: bytes=", head, re.I):
                        self.gets += 1
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self):
        self.stopped.set()
        for s in [self.sock, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _words(n: int, k: int, seed: int = 0) -> bytes:
    """``n`` documents of ``k`` generated words (no real data; compresses about 3x, so the gzip object spans
    several reads too)."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
    return b"".join(json.dumps({"id": f"b{i}", "text": " ".join(rng.choices(words, k=k)), "domain": "abc"[i % 3]})
                    .encode() + b"\n" for i in range(n))


def _one_line_pattern(key: str, url: str, obj: str | None = None) -> str:
    return (re.escape(f"{key}={url!r}: cannot be read from the object store (") + r"(\w+): [^\n]*\) after ([\d,]+) "
            r"bytes" + (re.escape(f" of {obj}") if obj else "") + r" \(([\d.]+)% of ([\d,]+)\); check the endpoint "
            r"and network, then run again")


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet", "prefix"])
def test_c21_a_store_that_goes_away_mid_read_is_one_line_for_every_object_reader(s3, monkeypatch, kind):
    """In-process, every reader: the line names the URL (and, for a prefix, the object), the bytes that arrived and
    their share of the object. Reads of 64 KiB from blocks of 64 KiB, so a 2 MB object takes many ranged GETs."""
    import fsspec.config
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ccexp.data import remote
    from ccexp.data.corpus import CorpusReader
    from ccexp.errors import CcexpError

    data = _words(1000, 300)  # 2 MB
    base = f"c21/{kind.replace('.', '-')}/"
    url, obj = f"s3://{BUCKET}/{base}", None
    if kind == "prefix":  # the first object is read whole; the store goes away during the second
        s3.pipe(url + "part-1.jsonl", data.splitlines(keepends=True)[0])
        s3.pipe(url + "part-2.jsonl", data)
        obj, size = url + "part-2.jsonl", len(data)
    elif kind == "parquet":
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([json.loads(ln) for ln in data.splitlines()]), buf, row_group_size=50)
        url += "big.parquet"
        s3.pipe(url, buf.getvalue())
    else:
        url += "big.jsonl.gz" if kind == "jsonl.gz" else "big.jsonl"
        s3.pipe(url, gzip.compress(data) if kind == "jsonl.gz" else data)
    size = s3.size(obj or url)
    assert size > 3 * (1 << 16)  # more than the first ranged GET (a 64 KiB read and a 64 KiB block)

    endpoint = int(re.search(r":(\d+)$", os.environ["AWS_ENDPOINT_URL"]).group(1))
    proxy = StoppingProxy(endpoint, f"{BUCKET}/{base}", ranged=2 if kind == "prefix" else 1)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"default_block_size": 1 << 16, "endpoint_url": proxy.url,
                                                   "config_kwargs": {"retries": {"max_attempts": 2}}})
    monkeypatch.setattr(remote, "READ_BUFFER", 1 << 16, raising=False)
    try:
        reader = CorpusReader(url, label_fields=["domain"])
        with pytest.raises(CcexpError) as e:
            reader.read()
    finally:
        proxy.stop()
    assert proxy.stopped.is_set()
    line = str(e.value)
    m = re.fullmatch(_one_line_pattern("data.path", url, obj), line)
    assert m, line
    received, share, total = int(m.group(2).replace(",", "")), float(m.group(3)), int(m.group(4).replace(",", ""))
    assert total == size and 0 < received < size and abs(share - 100 * received / size) < 0.1, line
    documented(line)


def test_c21_an_object_overwritten_mid_read_is_the_changed_while_read_line(s3, monkeypatch):
    """The store answering mid-read that the object is no longer the one opened (s3fs's ranged GETs carry
    ``If-Match: <ETag>``): not "check the endpoint and network" but the corpus stage's line for a changed object."""
    import fsspec.config

    from ccexp.data import remote
    from ccexp.data.corpus import CorpusReader
    from ccexp.errors import CcexpError

    url = f"s3://{BUCKET}/c21/changed/big.jsonl"
    s3.pipe(url, _words(1000, 300))
    monkeypatch.setitem(fsspec.config.conf, "s3", {"default_block_size": 1 << 16})
    monkeypatch.setattr(remote, "READ_BUFFER", 1 << 16, raising=False)
    records = CorpusReader(url, label_fields=["domain"])._records()
    next(records)
    s3.pipe(url, _words(1000, 300, seed=1))  # overwritten: a new ETag
    with pytest.raises(CcexpError) as e:
        list(records)
    assert str(e.value) == f"data.path={url!r} changed in the object store while it was read; run again"
    documented(str(e.value))


def _stopped_run(s3, tmp_path, monkeypatch, *args: str):
    """Run ``python -m ccexp`` on ``s3://corpora/c21/cli/big.jsonl`` (2.5 MB) through a proxy that stops at the
    first request after the object's first ranged GET; return the run and its ``ccexp:`` line."""
    url = f"s3://{BUCKET}/c21/cli/big.jsonl"
    if not s3.exists(url):
        s3.pipe(url, _words(800, 600))
    endpoint = int(re.search(r":(\d+)$", os.environ["AWS_ENDPOINT_URL"]).group(1))
    proxy = StoppingProxy(endpoint, f"{BUCKET}/c21/cli/big.jsonl")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # the run's environment: the proxy in front of the server
    monkeypatch.setenv("FSSPEC_S3_DEFAULT_BLOCK_SIZE", str(1 << 18))  # 256 KiB blocks: a 3.2 MB object, many GETs
    try:
        proc = run_ccexp(*TINY, *args, f"paths.outputs={tmp_path / 'out'}", cwd=tmp_path)
    finally:
        proxy.stop()
    assert proxy.stopped.is_set(), "the run never asked for more than the first ranged GET"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ccexp:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    corpus = tmp_path / "out" / "cache" / "corpus"
    assert not corpus.exists() or not [p for p in corpus.iterdir() if p.is_dir()], list(corpus.iterdir())
    return proc, lines[0], url, s3.size(url)


@pytest.mark.parametrize("via", ["data.path", "data.sources"])
def test_c21_the_server_stopping_during_the_corpus_stage_is_one_line_exit_2_and_nothing_cached(s3, tmp_path,
                                                                                                monkeypatch, via):
    """The case through the CLI (s3fs's and botocore's own retries, default settings but the block size): exit 2,
    the one line of docs/errors.md naming the setting (``data.sources[0].path`` for a source), the URL and how far
    the read got, no traceback, no corpus stage published (nor a folder that could pass for one)."""
    url = f"s3://{BUCKET}/c21/cli/big.jsonl"
    args = ["data=jsonl", f"data.path={url}"] if via == "data.path" else [
        "data=sources", f"data.sources=[{{path: '{url}', name: big}}]", "data.label_fields=[source,domain]"]
    proc, line, url, size = _stopped_run(s3, tmp_path, monkeypatch, *args)
    key = "data.path" if via == "data.path" else "data.sources[0].path"
    m = re.fullmatch("ccexp: error: " + _one_line_pattern(key, url), line)
    assert m and m.group(1) in ("EndpointConnectionError", "ConnectionClosedError"), line
    received, total = int(m.group(2).replace(",", "")), int(m.group(4).replace(",", ""))
    assert total == size and 0 < received < size, line
    documented(line.removeprefix("ccexp: error: "))
