"""Corpus readers (JSON lines, plain or gzip, and Parquet) and the deterministic held-out split.

A corpus is held column-wise: ``ids`` and ``texts`` (lists of str, length N) and ``labels``
(name -> list of str, e.g. ``domain``), never as per-document objects beyond the strings.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")

BUILTIN_PATH = Path(__file__).parent / "builtin" / "debmix_mini.jsonl.gz"


@dataclass
class Corpus:
    """Column-wise documents. ``heldout`` is bool[N], True for held-out documents (see :func:`split_heldout`)."""

    ids: list[str]
    texts: list[str]
    labels: dict[str, list[str]] = field(default_factory=dict)
    heldout: np.ndarray | None = None
    # instruction data: int64[N] characters of each text that are its prompt (text = prompt + response);
    # only the response is trained on. None for plain documents.
    prompt_chars: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.texts)


def detect_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".ndjson.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise CcexpError(f"data.path={str(path)!r}: cannot tell the format from the name; use a .jsonl, "
                     ".jsonl.gz or .parquet file, or set data.format=jsonl|parquet")


def _iter_jsonl(path: Path):
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CcexpError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start}); re-encode the file "
                                     "as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
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


def _iter_parquet(path: Path, columns: list[str]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise CcexpError(f"{path}: not a readable Parquet file ({e})") from None
    missing = [c for c in columns if c not in pf.schema_arrow.names]
    if missing:
        raise CcexpError(f"{path}: has no column {missing[0]!r}; columns are {pf.schema_arrow.names}; "
                         "set data.text_field / data.id_field / data.label_fields accordingly")
    row = 0
    batches = pf.iter_batches(columns=columns, batch_size=65536)
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as e:
            raise CcexpError(f"{path}: damaged Parquet data after row {row} ({str(e).splitlines()[0][:100]}); "
                             "re-export the file") from None
        if batch is None:
            return
        cols = batch.to_pydict()
        for i in range(batch.num_rows):
            row += 1
            yield row, {c: cols[c][i] for c in columns}


def read_corpus(path: str | Path, *, format: str = "auto", text_field: str = "text", id_field: str | None = "id",
                label_fields: list[str] | None = None, drop_empty: bool = True,
                max_documents: int | None = None, response_field: str | None = None) -> Corpus:
    """Read documents from a JSON-lines (optionally gzip) or Parquet file.

    Args:
        path: the file.
        format: ``auto`` (from the suffix), ``jsonl`` or ``parquet``.
        text_field: the field holding the document text (str).
        id_field: the field holding a unique document id; None or absent -> ``row-<n>``.
        label_fields: optional string label fields (e.g. ``["domain"]``) kept for evaluation.
        drop_empty: drop documents whose text is empty or whitespace (logged); else raise.
        max_documents: keep only this many documents, chosen by the smallest hash of their id (a
            deterministic subsample that keeps the corpus mix in expectation).
        response_field: instruction data (supervised fine-tuning): ``text_field`` holds the prompt and
            this field the response; a document is prompt + response, and ``Corpus.prompt_chars``
            marks where the response starts (only response tokens are trained on).

    Raises:
        CcexpError: missing file, unknown format, invalid UTF-8 or JSON, a missing or non-string
            text field, empty documents with ``drop_empty=False``, or no documents left.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise CcexpError(f"data.path={str(path)!r} is a folder; point data.path at one .jsonl, .jsonl.gz or .parquet file")
    if not path.is_file():
        raise CcexpError(f"data.path={str(path)!r} does not exist; point data.path at a .jsonl, .jsonl.gz or "
                         ".parquet file")
    fmt = detect_format(path) if format == "auto" else format
    label_fields = list(label_fields or [])
    if fmt == "jsonl":
        records = _iter_jsonl(path)
    elif fmt == "parquet":
        records = _iter_parquet(path, [text_field] + ([response_field] if response_field else [])
                                + ([id_field] if id_field else []) + label_fields)
    else:
        raise CcexpError(f"data.format={fmt!r} is not an option; use auto, jsonl or parquet")

    ids: list[str] = []
    texts: list[str] = []
    prompt_chars: list[int] = []
    labels: dict[str, list[str]] = {name: [] for name in label_fields}
    empty = 0
    for row, rec in records:
        if text_field not in rec:
            raise CcexpError(f"{path}: record {row} has no field {text_field!r} (fields: {sorted(rec)}); set "
                             f"data.text_field to the field that holds the text")
        text = rec[text_field]
        if not isinstance(text, str):
            raise CcexpError(f"{path}: record {row} field {text_field!r} is {type(text).__name__}, not a string; set "
                             "data.text_field to the field that holds the document text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise CcexpError(f"{path}: record {row} field {text_field!r} holds a lone surrogate (an escaped "
                             "\\ud800-\\udfff without its pair), which is not valid Unicode; fix that record") from None
        prompt = text
        if response_field:
            response = _response(path, row, rec, response_field)
            text = prompt + response
        if not (response.strip() if response_field else text.strip()):
            if not drop_empty:
                raise CcexpError(f"{path}: record {row} has an empty {response_field or text_field!r}; remove it "
                                 "or set data.drop_empty=true")
            empty += 1
            continue
        doc_id = rec.get(id_field) if id_field else None
        ids.append(str(doc_id) if doc_id is not None else f"row-{row}")
        texts.append(text)
        prompt_chars.append(len(prompt))
        for name in label_fields:
            value = rec.get(name)
            labels[name].append("(none)" if value is None or value == "" else str(value))
    if empty:
        log.warning("corpus: dropped %d empty document(s) from %s", empty, path)
    if not texts:
        raise CcexpError(f"{path}: no non-empty documents in field {response_field or text_field!r}"
                         + ("; every response is empty" if response_field else ""))
    corpus = Corpus(ids, texts, labels, prompt_chars=np.asarray(prompt_chars, dtype=np.int64) if response_field else None)
    if max_documents is not None and max_documents < len(corpus):
        corpus = subset(corpus, np.sort(np.argsort(id_hash(corpus.ids, "subsample"))[:max_documents]))
    return corpus


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


def id_hash(ids: list[str], salt: str) -> np.ndarray:
    """float64[N] in [0, 1): a stable hash of each id (SHA-256 of ``salt:id``)."""
    out = np.empty(len(ids), dtype=np.float64)
    for k, doc_id in enumerate(ids):
        out[k] = int.from_bytes(hashlib.sha256(f"{salt}:{doc_id}".encode()).digest()[:8], "little") / 2**64
    return out


def split_heldout(ids: list[str], fraction: float, salt: str = "ccexp-heldout") -> np.ndarray:
    """bool[N]: True for held-out documents. Decided by a hash of each document id, so the same
    documents are held out for every sampler, seed and model.

    Raises:
        CcexpError: if ``fraction`` is not in (0, 1) or the split leaves a side empty.
    """
    if not 0.0 < fraction < 1.0:
        raise CcexpError(f"data.heldout_fraction must be in (0, 1), got {fraction}")
    heldout = id_hash(ids, salt) < fraction
    if heldout.all() or not heldout.any():
        raise CcexpError(f"data.heldout_fraction={fraction} leaves no training or no held-out documents among "
                         f"{len(ids)}; use a larger corpus or another fraction")
    return heldout


def subset(corpus: Corpus, index: np.ndarray) -> Corpus:
    return Corpus([corpus.ids[i] for i in index], [corpus.texts[i] for i in index],
                  {k: [v[i] for i in index] for k, v in corpus.labels.items()},
                  None if corpus.heldout is None else corpus.heldout[index],
                  None if corpus.prompt_chars is None else corpus.prompt_chars[index])
