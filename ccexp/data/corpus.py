"""Corpus readers (JSON lines, plain or gzip, and Parquet) and the deterministic held-out split.

A corpus is held column-wise: ``ids`` and ``texts`` (lists of str, length N) and ``labels``
(name -> list of str, e.g. ``domain``), never as per-document objects beyond the strings.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ccexp.data.remote import RemoteSource, is_url, local_or_url, resolve
from ccexp.data import userfiles
from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")

BUILTIN_PATH = Path(__file__).parent / "builtin" / "debmix_mini.jsonl.gz"
HELDOUT_SALT = "ccexp-heldout"  # changing it changes every run's held-out split


@dataclass
class Corpus:
    """Column-wise documents. ``ids``, ``texts`` and each ``labels`` value are sequences of N str — lists
    in memory ([`read_corpus`][ccexp.data.corpus.read_corpus]), or columns of the corpus stage's Parquet shards read on demand
    (`ccexp.data.store.ShardColumn`); take many of them with [`take`][ccexp.data.corpus.take]. ``heldout`` is bool[N],
    True for held-out documents (see [`split_heldout`][ccexp.data.corpus.split_heldout])."""

    ids: Sequence[str]
    texts: Sequence[str]
    labels: dict[str, Sequence[str]] = field(default_factory=dict)
    heldout: np.ndarray | None = None
    # instruction data: int64[N] characters of each text that are its prompt (text = prompt + response);
    # only the response is trained on. None for plain documents.
    prompt_chars: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.texts)


def take(column: Sequence[str], docs) -> list[str]:
    """``[column[d] for d in docs]``, reading a shard-backed column once per row group it touches."""
    if hasattr(column, "take"):
        return column.take(docs)
    return [column[int(d)] for d in docs]


def check_source(path: str | Path, format: str = "auto") -> tuple[Path | RemoteSource, str]:
    """The corpus's path and format, checked without reading it (pre-flight calls this before any import of
    the heavy libraries, so a wrong path is known in about a second). A URL (``s3://``, ``gs://``, ``hf://``,
    ...; `ccexp.data.remote`) is checked through its object store and returned as a
    `RemoteSource` (one object, or a prefix's ``.jsonl(.gz)`` / ``.parquet`` objects).

    Raises:
        CcexpError: for a path or object that does not exist, an unknown format, a file/folder that does not
            match the format, a missing filesystem package or refused credentials.
    """
    if format not in ("auto", "jsonl", "parquet", "hf_disk"):
        raise CcexpError(f"data.format={format!r} is not an option; use auto, jsonl, parquet or hf_disk")
    if is_url(path):
        return resolve(str(path), format)
    path = local_or_url(path)
    if not path.exists():
        raise CcexpError(f"data.path={str(path)!r} does not exist; point data.path at a .jsonl, .jsonl.gz or "
                         ".parquet file, or a Hugging Face datasets folder (save_to_disk)")
    format = detect_format(path) if format == "auto" else format
    if path.is_dir() != (format == "hf_disk"):
        raise CcexpError(f"data.path={str(path)!r} is a folder; point data.path at one .jsonl, .jsonl.gz or "
                         ".parquet file, or read a datasets folder (save_to_disk) with data=hf_disk"
                         if path.is_dir() else
                         f"data.format=hf_disk needs a datasets folder (save_to_disk), but {str(path)!r} is a "
                         "file; use data.format=auto")
    return path, format


def detect_format(path: Path) -> str:
    """``jsonl``, ``parquet`` or ``hf_disk`` (a folder written by ``datasets``' ``save_to_disk``) from the path.

    Raises:
        CcexpError: for a name or folder it cannot tell.
    """
    if path.is_dir():
        if any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "hf_disk"
        raise CcexpError(f"data.path={str(path)!r} is a folder; point data.path at one .jsonl, .jsonl.gz or .parquet "
                         "file, or read a datasets folder (save_to_disk) with data=hf_disk")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".ndjson.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise CcexpError(f"data.path={str(path)!r}: cannot tell the format from the name; use a .jsonl, "
                     ".jsonl.gz or .parquet file, or set data.format=jsonl|parquet|hf_disk")


def _iter_jsonl(path: Path | str, raw=None):
    """``(line number, record)`` of a JSON-lines file or object (``raw``: an open binary file to read it from,
    e.g. an object store's), gzip decompressed as it streams when the name ends in ``.gz``."""
    gz = str(path).lower().endswith(".gz")
    try:
        with (raw if raw is not None else open(path, "rb")) as source, \
                (gzip.GzipFile(fileobj=source, mode="rb") if gz else source) as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark is no error
                except UnicodeDecodeError as e:
                    raise CcexpError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start}); re-encode the file "
                                     "as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    rec = userfiles.loads(line)
                except userfiles.RepeatedKey as e:
                    raise CcexpError(f"{path}:{lineno}: the record gives the field {e.key!r} twice; give each field "
                                     "once") from None
                except json.JSONDecodeError as e:
                    raise CcexpError(f"{path}:{lineno}: not a JSON object ({e.msg}, column {e.colno}); each line "
                                     "must be one JSON record") from None
                if not isinstance(rec, dict):
                    raise CcexpError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
                yield lineno, rec
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise CcexpError(f"{path}: cannot be read ({e}); is it a complete, uncorrupted file?") from None


def _iter_parquet(path: Path | str, columns: list[str], raw=None):
    """``(row number, record)`` of a Parquet file, read in batches of row groups (``raw``: an open binary file
    to read it from, e.g. an object store's; pyarrow reads the footer and the row groups' byte ranges)."""
    with raw if raw is not None else contextlib.nullcontext():
        yield from _parquet_rows(path, columns, raw if raw is not None else path)


def _parquet_rows(path: Path | str, columns: list[str], source):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(source)
    except CcexpError:  # an object store that failed mid-read (ccexp.data.remote.ObjectStream)
        raise
    except Exception as e:  # pyarrow raises several types for a bad file
        raise CcexpError(f"{path}: not a readable Parquet file ({e})") from None
    missing = [c for c in columns if c not in pf.schema_arrow.names]
    if missing:
        raise CcexpError(f"{path}: has no column {missing[0]!r}; columns are {pf.schema_arrow.names}; "
                         "set data.text_field / data.id_field / data.label_fields accordingly")
    row = 0
    batches = pf.iter_batches(columns=columns, batch_size=8192)
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as e:
            raise CcexpError(f"{path}: damaged Parquet data after row {row} ({str(e).splitlines()[0][:100]}); "
                             "re-export the file") from None
        if batch is None:
            return
        yield from _rows(batch, columns, row)
        row += batch.num_rows


def _rows(batch, columns: list[str], row: int):
    """``(row number, record)`` of each row of an Arrow batch or table, numbered from ``row + 1``."""
    cols = batch.to_pydict()
    for i in range(batch.num_rows):
        yield row + i + 1, {c: cols[c][i] for c in columns}


@dataclass
class CorpusBatch:
    """Up to ``documents`` validated documents, column-wise: ``ids``, ``texts`` (str lists of one length),
    ``labels`` (name -> str list) and ``prompt_chars`` (int list; None for plain documents)."""

    ids: list[str]
    texts: list[str]
    labels: dict[str, list[str]]
    prompt_chars: list[int] | None

    def add(self, doc_id: str, text: str, prompt_chars: int, labels: dict[str, str]) -> None:
        """Append one document (``prompt_chars`` is dropped for plain documents)."""
        self.ids.append(doc_id)
        self.texts.append(text)
        if self.prompt_chars is not None:
            self.prompt_chars.append(prompt_chars)
        for name, values in self.labels.items():
            values.append(labels[name])


def subsample(read: Callable[[bool], Iterator[CorpusBatch]], max_documents: int,
              documents: int) -> Iterator[CorpusBatch]:
    """The ``max_documents`` documents of a corpus with the smallest hash of their id (a subsample that
    does not depend on the order), in their order, in batches of ``documents``. ``read(warn)`` yields the
    whole corpus's validated batches and is called twice: first for the ids (``warn=False``), then for
    the documents kept. A multi-source corpus is subsampled as one (its ids ``<source>/<id>``)."""
    hashes = np.concatenate([id_hash(b.ids, "subsample") for b in read(False)])
    keep = np.zeros(hashes.size, dtype=bool)
    keep[np.argsort(hashes, kind="stable")[:max_documents]] = True
    out, seen = None, 0
    for b in read(True):
        if out is None:
            out = CorpusBatch([], [], {k: [] for k in b.labels}, [] if b.prompt_chars is not None else None)
        for k in np.flatnonzero(keep[seen:seen + len(b.texts)]).tolist():
            out.add(b.ids[k], b.texts[k], b.prompt_chars[k] if b.prompt_chars is not None else 0,
                    {name: values[k] for name, values in b.labels.items()})
            if len(out.texts) == documents:
                yield out
                out = CorpusBatch([], [], {k: [] for k in out.labels}, [] if out.prompt_chars is not None else None)
        seen += len(b.texts)
    if out is not None and out.texts:
        yield out


class CorpusReader:
    """A corpus on disk, read in batches: a JSON-lines file (optionally gzip), a Parquet file, or a
    Hugging Face ``datasets`` folder written by ``save_to_disk`` (``format=hf_disk``: read with
    ``datasets.load_from_disk``, memory-mapped Arrow, never downloaded) — or JSON-lines / Parquet objects in
    an object store (a ``s3://``, ``gs://``, ``hf://``, ... URL: `ccexp.data.remote`), streamed through
    fsspec. Memory stays bounded by one
    batch: [`batches`][ccexp.data.corpus.CorpusReader.batches] is what the corpus stage streams into its Parquet shards; [`read`][ccexp.data.corpus.CorpusReader.read]
    collects everything for small corpora and tests.

    Args:
        path: the file or folder, or a URL of one object or a prefix of them.
        format: ``auto`` (from the suffix, or a ``datasets`` folder), ``jsonl``, ``parquet`` or ``hf_disk``.
        text_field: the field holding the document text (str).
        id_field: the field holding a unique document id; None or absent -> ``row-<n>``.
        label_fields: optional string label fields (e.g. ``["domain"]``) kept for evaluation.
        drop_empty: drop documents whose text is empty or whitespace (logged); else raise.
        max_documents: keep only this many documents, chosen by the smallest hash of their id (a
            deterministic subsample that keeps the corpus mix in expectation; costs a second read).
        response_field: instruction data (supervised fine-tuning): ``text_field`` holds the prompt and
            this field the response; a document is prompt + response, and ``prompt_chars`` marks where
            the response starts (only response tokens are trained on).
        split: the split of a ``datasets`` folder holding a ``DatasetDict``.

    Raises:
        CcexpError: a missing path, a folder that is not a ``datasets`` folder, or an unknown format.
    """

    def __init__(self, path: str | Path, *, format: str = "auto", text_field: str = "text",
                 id_field: str | None = "id", label_fields: list[str] | None = None, drop_empty: bool = True,
                 max_documents: int | None = None, response_field: str | None = None, split: str = "train"):
        self.path, self.format = check_source(path, format)
        self.text_field, self.id_field, self.label_fields = text_field, id_field, list(label_fields or [])
        self.drop_empty, self.max_documents, self.response_field = drop_empty, max_documents, response_field
        self.split = split
        self.label_hint: list[list] = []  # fields that look like labels but were not asked for (after a read)

    def _records(self):
        columns = ([self.text_field] + ([self.response_field] if self.response_field else [])
                   + ([self.id_field] if self.id_field else []) + self.label_fields)
        if isinstance(self.path, RemoteSource):
            return self._remote_records(columns)
        if self.format == "jsonl":
            return _iter_jsonl(self.path)
        if self.format == "parquet":
            return _iter_parquet(self.path, columns)
        return _iter_hf_disk(self.path, columns, self.split, optional=[self.id_field] if self.id_field else [])

    def _remote_records(self, columns: list[str]):
        """The records of each object of a `RemoteSource` in turn, streamed; rows are
        numbered on across objects (so ``row-<n>`` ids stay unique), and one object's are its own."""
        src, offset = self.path, 0
        for obj in src.objects:
            name, last = src.name(obj), 0
            raw = src.open(obj)  # buffered (lines cut from 1 MiB reads); a store failing mid-read is one line
            records = _iter_jsonl(name, raw) if self.format == "jsonl" else _iter_parquet(name, columns, raw)
            for last, rec in records:
                yield offset + last, rec
            offset += last

    def _validated(self, documents: int, warn: bool = True) -> Iterator[CorpusBatch]:
        """Every non-empty document, validated, in batches of ``documents`` (``warn``: log the empty
        documents dropped).

        Raises:
            CcexpError: a missing or non-string text field, empty documents with ``drop_empty=False``,
                or no documents at all.
        """
        batch, empty, total = self._new_batch(), 0, 0
        fields = _FieldCensus(self.label_fields)
        for row, rec in self._records():
            text, prompt = self._text(row, rec)
            if text is None:
                empty += 1
                continue
            fields.add(rec)
            doc_id = rec.get(self.id_field) if self.id_field else None
            batch.add(str(doc_id) if doc_id is not None else f"row-{row}", text, len(prompt),
                      {name: _label_value(rec.get(name), self.path, row, name) for name in self.label_fields})
            if len(batch.texts) == documents:
                total += documents
                yield batch
                batch = self._new_batch()
        if empty and warn:
            log.warning("corpus: dropped %d empty document(s) from %s", empty, self.path)
        fields.check(self.path, warn)
        skip = {self.text_field, self.id_field, self.response_field, *self.label_fields}
        self.label_hint = fields.hint(skip)
        if not total and not batch.texts:
            raise CcexpError(f"{self.path}: no non-empty documents in field {self.response_field or self.text_field!r}"
                             + ("; every response is empty" if self.response_field else ""))
        if batch.texts:
            yield batch

    def _new_batch(self) -> CorpusBatch:
        return CorpusBatch([], [], {name: [] for name in self.label_fields}, [] if self.response_field else None)

    def _text(self, row: int, rec: dict) -> tuple[str | None, str]:
        """The document (prompt + response for instruction data) and its prompt; None for an empty one."""
        path, text_field = self.path, self.text_field
        if text_field not in rec:
            raise CcexpError(f"{path}: record {row} has no field {text_field!r} (fields: {sorted(rec)}); set "
                             f"data.text_field to the field that holds the text")
        text = rec[text_field]
        if text is None:
            raise CcexpError(f"{path}: record {row} field {text_field!r} is null; give every record a text (or drop "
                             "the record)")
        if not isinstance(text, str):
            raise CcexpError(f"{path}: record {row} field {text_field!r} is {type(text).__name__}, not a string; set "
                             "data.text_field to the field that holds the document text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise CcexpError(f"{path}: record {row} field {text_field!r} holds a lone surrogate (an escaped "
                             "\\ud800-\\udfff without its pair), which is not valid Unicode; fix that record") from None
        prompt = text
        if self.response_field:
            response = _response(path, row, rec, self.response_field)
            text = prompt + response
        if not (response.strip() if self.response_field else text.strip()):
            if not self.drop_empty:
                raise CcexpError(f"{path}: record {row} has an empty {self.response_field or text_field!r}; remove it "
                                 "or set data.drop_empty=true")
            return None, prompt
        return text, prompt

    def batches(self, documents: int = 65536, warn: bool = True) -> Iterator[CorpusBatch]:
        """The corpus in batches of ``documents`` (the last may be shorter), after ``max_documents``
        (``warn``: log the empty documents dropped).

        Raises:
            CcexpError: see `_validated` and the format readers.
        """
        if self.max_documents is None:
            yield from self._validated(documents, warn=warn)
            return
        yield from subsample(lambda warn: self._validated(65536, warn=warn), self.max_documents, documents)

    def read(self) -> Corpus:
        """The whole corpus in memory (small corpora and tests; the corpus stage streams [`batches`][ccexp.data.corpus.CorpusReader.batches])."""
        ids, texts, prompt_chars = [], [], []
        labels: dict[str, list[str]] = {name: [] for name in self.label_fields}
        for b in self.batches():
            ids += b.ids
            texts += b.texts
            prompt_chars += b.prompt_chars or []
            for name in labels:
                labels[name] += b.labels[name]
        return Corpus(ids, texts, labels,
                      prompt_chars=np.asarray(prompt_chars, dtype=np.int64) if self.response_field else None)


def _iter_hf_disk(path: Path, columns: list[str], split: str, optional: list[str]):
    """Records of a Hugging Face ``datasets`` folder (``save_to_disk``), read in Arrow record batches."""
    try:
        import datasets
    except ImportError:
        raise CcexpError("data.format=hf_disk needs the `datasets` package; pip install datasets") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types for a damaged or empty folder
        raise CcexpError(f"{path}: not a readable datasets folder, or one without rows ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:120]}); write it with Dataset.save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise CcexpError(f"{path}: the datasets folder has splits {sorted(ds)}, not data.split={split!r}; set "
                             "data.split to one of them")
        ds = ds[split]
    elif split != "train":
        log.warning("corpus: %s holds one dataset, not a DatasetDict with splits; data.split=%s is ignored and all "
                    "its rows are read", path, split)
    present = [c for c in columns if c in ds.column_names]
    missing = [c for c in columns if c not in ds.column_names and c not in optional]
    if missing:
        raise CcexpError(f"{path}: has no column {missing[0]!r}; columns are {ds.column_names}; set data.text_field / "
                         "data.id_field / data.label_fields accordingly")
    row = 0
    for table in ds.select_columns(present).with_format("arrow").iter(batch_size=8192):
        yield from _rows(table, present, row)
        row += table.num_rows


class _FieldCensus:
    """What the records carry, for the label checks: per configured label field, the records that lack it
    (or leave it empty); over the first [`SAMPLE`][ccexp.data.corpus._FieldCensus.SAMPLE] records, each field's short string values, for a
    hint when a field looks like a label nobody asked for."""

    SAMPLE = 2000

    def __init__(self, label_fields: list[str]):
        self.missing = dict.fromkeys(label_fields, 0)
        self.records = 0
        self.seen: dict[str, int] = {}
        self.values: dict[str, set] = {}
        self.numbers = dict.fromkeys(label_fields, 0)  # records whose label is a non-integral number
        self.distinct: dict[str, set] = {name: set() for name in label_fields}  # label values, up to MANY + 1

    MANY = 64  # more label values than this, from numbers: a measurement, not a category

    def add(self, rec: dict) -> None:
        self.records += 1
        for name in self.missing:
            value = rec.get(name)
            if value in (None, ""):
                self.missing[name] += 1
            elif isinstance(value, float) and not value.is_integer():
                self.numbers[name] += 1
            if len(self.distinct[name]) <= self.MANY and (value is None or isinstance(value, (str, int, float, bool))):
                self.distinct[name].add(_label_value(value))  # (a structure is refused by the reader, with its row)
        if self.records <= self.SAMPLE:
            for key, value in rec.items():
                self.seen[key] = self.seen.get(key, 0) + 1
                if isinstance(value, str) and len(value) <= 80 and len(self.values.setdefault(key, set())) <= 64:
                    self.values[key].add(value)

    def check(self, path, warn: bool = True) -> None:
        """A configured label field that no record has is an error naming the fields that exist; one
        that most records lack is a warning (they count as ``(none)``).

        Raises:
            CcexpError: for a label field absent from (or empty in) every record.
        """
        import difflib

        for name, missing in self.missing.items():
            if self.records and missing == self.records:
                close = difflib.get_close_matches(name, list(self.seen), n=1)
                raise CcexpError(f"data.label_fields: no record of {path} has a field {name!r}"
                                 + (f"; did you mean {close[0]!r}?" if close else "")
                                 + f" (fields: {sorted(self.seen)})")
            if warn and missing > self.records / 2:
                log.warning("corpus: label field %r is missing or empty in %s of %s records; they count as the value "
                            "'(none)'", name, f"{missing:,}", f"{self.records:,}")
            if warn and self.numbers[name] > self.records / 2 and len(self.distinct[name]) > self.MANY:
                log.warning("corpus: label field %r holds a fractional number in %s of %s records (more than %d "
                            "distinct values): each value is a label of its own, a group of a few documents; a label "
                            "is a category (a domain, a source): bin the numbers into a few named ranges first, or "
                            "leave the field out of data.label_fields", name, f"{self.numbers[name]:,}",
                            f"{self.records:,}", self.MANY)

    def hint(self, skip: set) -> list[list]:
        """[field, values, examples] for each field that looks like a label (a string with 2 to 64 values in
        nearly every sampled record) but was not asked for."""
        n = min(self.records, self.SAMPLE)
        return [[key, len(vals), sorted(vals)[:3]] for key, vals in sorted(self.values.items())
                if key not in skip and 2 <= len(vals) <= 64 and self.seen.get(key, 0) >= 0.9 * n
                and len(vals) <= max(2, n // 5)]


def _label_value(value, path=None, row: int = 0, name: str = "") -> str:
    """A label value as text (a string, a number, a boolean); a missing or empty one is the visible placeholder
    ``(none)``.

    Raises:
        CcexpError: for a list, a mapping or another structure (a label names one group: ``["a", "b"]`` would be read
            as a group named by its printed text).
    """
    if value is None or value == "":
        return "(none)"
    if not isinstance(value, (str, int, float, bool)):
        raise CcexpError(f"{path}: record {row} field {name!r} is a {type(value).__name__} ({str(value)[:60]}); a "
                         "label is one value (a string or a number) per document")
    return str(value)


def read_corpus(path: str | Path, **options) -> Corpus:
    """Read a whole corpus into memory: ``CorpusReader(path, **options).read()`` (see [`CorpusReader`][ccexp.data.corpus.CorpusReader]).

    Raises:
        CcexpError: missing file, unknown format, invalid UTF-8 or JSON, a missing or non-string
            text field, empty documents with ``drop_empty=False``, or no documents left.
    """
    return CorpusReader(path, **options).read()


def _response(path: Path, row: int, rec: dict, response_field: str) -> str:
    if response_field not in rec:
        raise CcexpError(f"{path}: record {row} has no field {response_field!r} (fields: {sorted(rec)}); set "
                         "data.response_field to the field that holds the response, or null for plain documents")
    response = rec[response_field]
    if not isinstance(response, str):
        kind = "null" if response is None else type(response).__name__
        raise CcexpError(f"{path}: record {row} field {response_field!r} is {kind}, not a string; give every record a "
                         "text response (or drop the record)")
    try:
        response.encode("utf-8")
    except UnicodeEncodeError:
        raise CcexpError(f"{path}: record {row} field {response_field!r} holds a lone surrogate (an escaped "
                         "\\ud800-\\udfff without its pair), which is not valid Unicode; fix that record") from None
    return response


def id_hash64(ids: Sequence[str], salt: str) -> np.ndarray:
    """uint64[N]: a stable 64-bit hash of each id (the first 8 bytes of SHA-256 of ``salt:id``)."""
    return np.fromiter((int.from_bytes(hashlib.sha256(f"{salt}:{doc_id}".encode()).digest()[:8], "little")
                        for doc_id in ids), dtype=np.uint64, count=len(ids))


def id_hash(ids: Sequence[str], salt: str) -> np.ndarray:
    """float64[N] in [0, 1): [`id_hash64`][ccexp.data.corpus.id_hash64] scaled to the unit interval."""
    return id_hash64(ids, salt) / 2.0**64


def check_heldout_fraction(fraction: float) -> None:
    """Raises CcexpError unless ``fraction`` is in (0, 1)."""
    if not 0.0 < fraction < 1.0:
        raise CcexpError(f"data.heldout_fraction={fraction} must be in (0, 1)")


def check_split(held: int, documents: int, fraction: float) -> None:
    """Raises CcexpError if ``held`` of ``documents`` held out leaves a side empty."""
    if held in (0, documents):
        raise CcexpError(f"data.heldout_fraction={fraction} leaves no training or no held-out documents among "
                         f"{documents}; use a larger corpus or another fraction")


def split_heldout(ids: Sequence[str], fraction: float, salt: str = HELDOUT_SALT) -> np.ndarray:
    """bool[N]: True for held-out documents. Decided by a hash of each document id, so the same
    documents are held out for every sampler, seed and model (and for any sharding of the corpus:
    the corpus stage calls [`heldout_flags`][ccexp.data.corpus.heldout_flags] shard by shard, then [`check_split`][ccexp.data.corpus.check_split]).

    Raises:
        CcexpError: if ``fraction`` is not in (0, 1) or the split leaves a side empty.
    """
    check_heldout_fraction(fraction)
    heldout = heldout_flags(ids, fraction, salt)
    check_split(int(heldout.sum()), heldout.size, fraction)
    return heldout


def stratify_heldout(heldout: np.ndarray, values: Sequence[str], ids: Sequence[str], min_per_value: int,
                     salt: str = HELDOUT_SALT) -> np.ndarray:
    """bool[N]: ``heldout`` (the hash split) with more documents held out for every label value that has
    fewer than ``min_per_value``: the value's training documents with the smallest id hashes (the
    ones the hash split would hold out next), up to ``min_per_value`` held-out documents in all and
    never more than half of the value's documents — so a rare domain's held-out perplexity rests on
    enough documents to mean something, and the split stays a deterministic function of the ids.

    Args:
        heldout: bool[N] the hash split; values: N label values (str); ids: N document ids.
        min_per_value: held-out documents every value should have (0: no change).
    """
    out = np.asarray(heldout, dtype=bool).copy()
    if min_per_value <= 0:
        return out
    uniq, inv = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    counts = np.bincount(inv, minlength=uniq.size)
    held = np.bincount(inv, weights=out, minlength=uniq.size).astype(np.int64)
    want = np.minimum(min_per_value, counts // 2) - held
    short = np.flatnonzero(want > 0)
    if short.size == 0:
        return out
    candidates = np.flatnonzero(np.isin(inv, short) & ~out)
    hashes = id_hash([ids[i] for i in candidates], salt)
    order = candidates[np.lexsort((hashes, inv[candidates]))]  # by value, then by hash
    rank = np.arange(order.size) - np.searchsorted(inv[order], inv[order])
    out[order[rank < want[inv[order]]]] = True
    return out


def heldout_flags(ids: Sequence[str], fraction: float, salt: str = HELDOUT_SALT) -> np.ndarray:
    """bool[n]: [`split_heldout`][ccexp.data.corpus.split_heldout]'s decision for each of ``ids``, without its checks — for a corpus
    split shard by shard (the caller checks the whole with [`check_split`][ccexp.data.corpus.check_split])."""
    return id_hash(ids, salt) < fraction
