"""The corpus stage's sharded Parquet store, written and read without holding the corpus in memory.

[`write_corpus`][ccexp.data.store.write_corpus] streams a [`CorpusReader`][ccexp.data.corpus.CorpusReader]'s batches into
``corpus-<i>.parquet`` shards of ``shard_documents`` documents (columns ``id``, ``text``,
``heldout``, ``prompt_chars`` for instruction data, ``label.<name>``; row groups of
[`ROW_GROUP`][ccexp.data.store.ROW_GROUP] documents), deciding the held-out split and the content digest shard by shard.
[`open_corpus`][ccexp.data.store.open_corpus] returns a [`Corpus`][ccexp.data.corpus.Corpus] whose ``ids``, ``texts`` and
labels are [`ShardColumn`][ccexp.data.store.ShardColumn] s: sequences that read one row group at a time (a few row groups are
cached), so iterating the texts — tokenizer training, tokenization, embedding — stays at one row
group's memory whatever the corpus size.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from ccexp.data.corpus import (HELDOUT_SALT, Corpus, CorpusBatch, check_heldout_fraction, check_split, id_hash,
                               id_hash64, stratify_heldout)

log = logging.getLogger("ccexp")

ROW_GROUP = 8192  # documents per Parquet row group: the unit of a random read
_SHARD = "corpus-{:06d}.parquet"


def write_corpus(batches: Iterable[CorpusBatch], out_dir: Path, *, heldout_fraction: float,
                 label_fields: Sequence[str] = (), stratify: str | None = None, min_per_value: int = 0) -> dict:
    """Write each batch (one shard's documents) as ``out_dir/corpus-<i>.parquet`` with its held-out flags.

    Args:
        batches: validated documents, one batch per shard (e.g. ``CorpusReader.batches(shard_documents)``).
        heldout_fraction: the held-out share in (0, 1), decided per document by a hash of its id.
        label_fields: the label columns to write.
        stratify, min_per_value: a label field of ``label_fields`` whose every value gets at least
            ``min_per_value`` held-out documents ([`stratify_heldout`][ccexp.data.corpus.stratify_heldout]; the
            shards are rewritten with the final flags); ``"auto"``: the first of ``label_fields``, only when
            the hash split holds out no document of one of its values (that value could not be scored);
            None: the hash split alone. Values of any label left without a held-out document are named in a
            warning.

    Returns:
        figures: ``documents``, ``heldout``, ``shards``, ``content`` (a 16-hex-digit SHA-256 over every
        document's id, text and held-out flag, in order: the same for any shard size), ``label_fields``,
        ``labels`` (a digest of the label values, None without labels), ``repeated_ids`` /
        ``repeated_rows`` when ids repeat, and, when stratified, ``stratified_added`` (documents the
        stratification held out).

    Raises:
        CcexpError: from the reader, or if the split leaves no training or no held-out document.
    """
    check_heldout_fraction(heldout_fraction)
    content, documents, held_total, shards = hashlib.sha256(), 0, 0, 0
    hashes = []  # uint64 id hashes of every document, to find ids that repeat (8 bytes per document)
    labels = hashlib.sha256()  # the label values, in order: what the stages' reports read
    values: dict[str, set] = {name: set() for name in label_fields}  # distinct values per label (for the log)
    t0 = last = time.perf_counter()
    for batch in batches:
        hashes.append(id_hash64(batch.ids, HELDOUT_SALT))
        heldout = hashes[-1] / 2.0**64 < heldout_fraction  # heldout_flags' decision
        _write_shard(batch, heldout, out_dir / _SHARD.format(shards), label_fields, content=content, labels=labels,
                     values=values)
        shards, documents, held_total = shards + 1, documents + len(batch.texts), held_total + int(heldout.sum())
        if (now := time.perf_counter()) - last >= 10.0:
            last = now
            log.info("corpus: %s documents in %d shards, %.0f docs/s", f"{documents:,}", shards, documents / (now - t0))
    figures = {"label_fields": list(label_fields), "labels": labels.hexdigest()[:16] if label_fields else None,
               "label_values": {name: len(v) for name, v in values.items()}}
    files = [out_dir / _SHARD.format(i) for i in range(shards)]
    held_change, more = _settle_heldout(files, hashes, heldout_fraction, content, stratify=stratify,
                                        min_per_value=min_per_value, label_fields=list(label_fields))
    held_total += held_change
    figures.update(more)
    check_split(held_total, documents, heldout_fraction)
    (out_dir / "shards.json").write_text(json.dumps({"shards": shards, "documents": documents}))
    return {"documents": documents, "heldout": held_total, "shards": shards, "content": content.hexdigest()[:16],
            **figures}


def _write_shard(batch: CorpusBatch, heldout: np.ndarray, path: Path, label_fields: Sequence[str], *, content,
                 labels, values: dict[str, set]) -> None:
    """Write one batch as the shard ``path``, adding it to the ``content`` / ``labels`` digests and ``values``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for doc_id, text, held in zip(batch.ids, batch.texts, heldout):
        content.update(f"{len(doc_id)}:{doc_id}{len(text)}:{text}{int(held)}".encode())
    columns = {"id": batch.ids, "text": batch.texts, "heldout": heldout}
    if batch.prompt_chars is not None:
        prompt_chars = np.asarray(batch.prompt_chars, dtype=np.int64)
        content.update(prompt_chars.tobytes())
        columns["prompt_chars"] = prompt_chars
    columns.update({f"label.{name}": batch.labels[name] for name in label_fields})
    for name in label_fields:
        labels.update(json.dumps([name, batch.labels[name]], ensure_ascii=False).encode())
        if len(values[name]) <= 100_000:
            values[name].update(batch.labels[name])
    pq.write_table(pa.table(columns), path, row_group_size=ROW_GROUP)


def _settle_heldout(files: list[Path], hashes: list[np.ndarray], heldout_fraction: float, content, *,
                    stratify: str | None, min_per_value: int, label_fields: list[str] = ()) -> tuple[int, dict]:
    """Rewrite the shards' flags for repeated ids and stratification; return the held-out change and figures."""
    figures: dict = {}
    held_change = 0
    repeats = _split_repeated_ids(files, np.concatenate(hashes) if hashes else np.zeros(0, np.uint64),
                                  heldout_fraction)
    if repeats is not None:
        content.update(b"repeats:" + repeats["changed"].tobytes())
        held_change += repeats["held_change"]
        figures["repeated_ids"], figures["repeated_rows"] = repeats["ids"], repeats["rows"]
    if stratify == "auto":
        stratify = _auto_stratify(files, label_fields, min_per_value)
    if stratify is not None and min_per_value > 0:
        added = _stratify_shards(files, stratify, min_per_value)
        content.update(f"stratified:{stratify}:{min_per_value}:".encode() + added.tobytes())
        held_change += int(added.size)
        figures["stratified_added"] = int(added.size)
    unscored = _values_without_heldout(files, label_fields)
    if unscored:
        figures["values_without_heldout"] = unscored
        log.warning("corpus: no held-out document of %s: their held-out perplexity cannot be scored, and the report "
                    "names them as not scored%s", "; ".join(f"{f} {', '.join(map(repr, v[:8]))}"
                                                           + (f" and {len(v) - 8} more" if len(v) > 8 else "")
                                                           for f, v in unscored.items()),
                    "" if stratify else f" (data.heldout_stratify={label_fields[0]} holds out up to "
                    f"data.heldout_min_per_value of each value, at most half of its documents)")
    return held_change, figures


def _held_per_value(files: list[Path], field: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, documents per value, held-out documents per value) of label ``field``."""
    columns, _ = _read_columns(files, ["heldout", f"label.{field}"])
    uniq, inv = np.unique(np.asarray(columns[f"label.{field}"], dtype=object).astype(str), return_inverse=True)
    return uniq, np.bincount(inv, minlength=uniq.size), np.bincount(inv, weights=columns["heldout"],
                                                                    minlength=uniq.size).astype(np.int64)


def _auto_stratify(files: list[Path], label_fields: list[str], min_per_value: int) -> str | None:
    """``data.heldout_stratify=auto``: the first label field when the hash split holds out no document of one of
    its values that has two or more (a value with one document cannot be held out without leaving training)."""
    if not label_fields or min_per_value <= 0:
        return None
    field = label_fields[0]
    values, counts, held = _held_per_value(files, field)
    missing = [str(v) for v, c, h in zip(values, counts, held) if h == 0 and c >= 2]
    if not missing:
        return None
    log.warning("corpus: the hash split held out no document of %s %s: held-out documents are stratified by %s "
                "(data.heldout_stratify=auto; =null keeps the plain hash split)", field,
                ", ".join(map(repr, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""), field)
    return field


def _values_without_heldout(files: list[Path], label_fields: list[str]) -> dict[str, list[str]]:
    """Per label field of at most 1,000 values (more is not a category: the corpus reader warns of those): its
    values with no held-out document."""
    out = {}
    for field in label_fields:
        values, counts, held = _held_per_value(files, field)
        if values.size <= 1000 and (held == 0).any():
            out[field] = [str(v) for v in values[held == 0]]
    return out

def _read_columns(files: list[Path], columns: list[str]) -> tuple[dict[str, list], np.ndarray]:
    """``columns`` of every shard, concatenated (lists; ``heldout`` as bool[N]), and the shards' row bounds."""
    import pyarrow.parquet as pq

    parts = [pq.read_table(f, columns=columns) for f in files]
    out = {c: [x for t in parts for x in t.column(c).to_pylist()] for c in columns if c != "heldout"}
    if "heldout" in columns:
        out["heldout"] = np.concatenate([t.column("heldout").to_numpy() for t in parts]).astype(bool)
    return out, np.cumsum([0] + [t.num_rows for t in parts])


def _rewrite_heldout(files: list[Path], bounds: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
    """Write the held-out flags ``after`` (bool[N]) into the shards whose flags differ from ``before``
    (each shard replaced atomically)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, f in enumerate(files):
        flags = after[bounds[i]:bounds[i + 1]]
        if (flags != before[bounds[i]:bounds[i + 1]]).any():
            table = pq.read_table(f)
            table = table.set_column(table.schema.get_field_index("heldout"), "heldout", pa.array(flags))
            tmp = f.with_suffix(".tmp")
            pq.write_table(table, tmp, row_group_size=ROW_GROUP)
            tmp.replace(f)


def _split_repeated_ids(files: list[Path], hashes: np.ndarray, fraction: float) -> dict | None:
    """Ids that repeat (compared as text: an int 0 and a string "0" are one id) would all fall on one side
    of the split, which is decided per id: the k-th repeat (k >= 1, corpus order) is split as ``<id>#<k>``
    instead, so the held-out fraction holds, and a warning names the ids. None when every id is unique.

    Returns:
        ``changed`` (int64[m] rows whose flag changed), ``held_change`` (the change in held-out rows),
        ``ids`` (distinct repeated ids) and ``rows`` (rows that share an id).
    """
    _, inverse, counts = np.unique(hashes, return_inverse=True, return_counts=True)
    if not (counts > 1).any():
        return None
    columns, bounds = _read_columns(files, ["id", "heldout"])
    candidates = np.flatnonzero(counts[inverse] > 1)  # equal 64-bit hashes; the ids themselves decide
    _, inverse_ids, counts_ids = np.unique(np.asarray([columns["id"][r] for r in candidates], dtype=object).astype(str),
                                           return_inverse=True, return_counts=True)
    inverse = np.full(hashes.size, -1, dtype=np.int64)
    inverse[candidates] = inverse_ids
    counts = counts_ids
    repeated = inverse >= 0
    repeated[candidates] = counts[inverse_ids] > 1
    if not repeated.any():
        return None
    rows = np.flatnonzero(repeated)
    order = rows[np.argsort(inverse[rows], kind="stable")]  # grouped by id, corpus order within
    k = np.arange(order.size) - np.searchsorted(inverse[order], inverse[order])
    later = order[k > 0]
    before = columns["heldout"]
    after = before.copy()
    after[later] = id_hash([f"{columns['id'][r]}#{j}" for r, j in zip(later, k[k > 0])], HELDOUT_SALT) < fraction
    _rewrite_heldout(files, bounds, before, after)
    top = sorted(((int(c), columns["id"][int(np.flatnonzero(inverse == u)[0])]) for u, c in enumerate(counts) if c > 1),
                 reverse=True)
    log.warning("corpus: %d id(s) repeat, in %s rows: %s; ids are compared as text (an int 0 and a string \"0\" are "
                "one id) and the held-out split is decided per id, so each repeat after the first is split as "
                "'<id>#<k>' to keep data.heldout_fraction. Give every record its own id, or set data.id_field=null "
                "to number the rows", len(top), f"{int(repeated.sum()):,}",
                ", ".join(f"{i!r} ({c} rows)" for c, i in top[:5]) + (", ..." if len(top) > 5 else ""))
    changed = np.flatnonzero(after != before)
    return {"changed": changed, "held_change": int(after.sum()) - int(before.sum()), "ids": len(top),
            "rows": int(repeated.sum())}


def _stratify_shards(files: list[Path], field: str, min_per_value: int) -> np.ndarray:
    """Hold out more documents of the rare values of label ``field`` ([`stratify_heldout`][ccexp.data.corpus.stratify_heldout]) and rewrite
    the shards whose flags changed; returns int64[m], the corpus indices newly held out."""
    columns, bounds = _read_columns(files, ["id", "heldout", f"label.{field}"])
    before = columns["heldout"]
    after = stratify_heldout(before, columns[f"label.{field}"], columns["id"], min_per_value)
    added = np.flatnonzero(after & ~before)
    _rewrite_heldout(files, bounds, before, after)
    if added.size:
        log.info("corpus: %s more documents held out so every %s has at least %d (or half of its documents)",
                 f"{added.size:,}", field, min_per_value)
    return added


def open_corpus(out_dir: Path) -> Corpus:
    """The corpus [`write_corpus`][ccexp.data.store.write_corpus] wrote: text columns read on demand, ``heldout`` (bool[N]) and
    ``prompt_chars`` (int64[N] or None) in memory."""
    import pyarrow.parquet as pq

    files = [out_dir / _SHARD.format(i) for i in range(json.loads((out_dir / "shards.json").read_text())["shards"])]
    schema = pq.read_schema(files[0])
    groups = _row_groups(files)
    heldout = np.concatenate([pq.read_table(f, columns=["heldout"]).column(0).to_numpy() for f in files]).astype(bool)
    prompt_chars = (np.concatenate([pq.read_table(f, columns=["prompt_chars"]).column(0).to_numpy() for f in files])
                    .astype(np.int64) if "prompt_chars" in schema.names else None)
    labels = {name[len("label."):]: ShardColumn(files, name, groups) for name in schema.names
              if name.startswith("label.")}
    return Corpus(ShardColumn(files, "id", groups), ShardColumn(files, "text", groups), labels, heldout, prompt_chars)


def _row_groups(files: list[Path]) -> np.ndarray:
    """int64[G, 3]: (first document, shard, row group) of every row group, in corpus order."""
    import pyarrow.parquet as pq

    rows, start = [], 0
    for shard, f in enumerate(files):
        meta = pq.ParquetFile(f).metadata
        for g in range(meta.num_row_groups):
            rows.append((start, shard, g))
            start += meta.row_group(g).num_rows
    rows.append((start, -1, -1))  # the end
    return np.asarray(rows, dtype=np.int64)


class ShardColumn(Sequence):
    """One string column of the sharded corpus as a read-only sequence of N str.

    Iteration streams the shards a row group at a time; ``column[i]`` reads (and caches) document i's
    row group; ``column[a:b]`` and [`take`][ccexp.data.store.ShardColumn.take] read each row group they touch once.
    """

    CACHED_GROUPS = 4

    def __init__(self, files: list[Path], column: str, groups: np.ndarray):
        self.files, self.column, self._groups = files, column, groups
        self._cache: OrderedDict[int, list[str]] = OrderedDict()

    def __len__(self) -> int:
        return int(self._groups[-1, 0])

    def __iter__(self) -> Iterator[str]:
        import pyarrow.parquet as pq

        for f in self.files:
            for batch in pq.ParquetFile(f).iter_batches(columns=[self.column], batch_size=ROW_GROUP):
                yield from batch.column(0).to_pylist()

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        g = int(np.searchsorted(self._groups[:, 0], i, side="right")) - 1
        return self._group(g)[i - int(self._groups[g, 0])]

    def take(self, docs) -> list[str]:
        """``[self[d] for d in docs]`` (docs: int[n], any order), reading each row group once."""
        docs = np.asarray(docs, dtype=np.int64).reshape(-1)
        if docs.size and (docs.min() < 0 or docs.max() >= len(self)):
            raise IndexError(f"documents {docs.min()}..{docs.max()} of {len(self)}")
        group = np.searchsorted(self._groups[:, 0], docs, side="right") - 1
        out: list = [None] * docs.size
        order = np.argsort(group, kind="stable")
        bounds = np.flatnonzero(np.diff(group[order])) + 1
        for run in np.split(order, bounds) if docs.size else []:
            g = int(group[run[0]])
            values = self._group(g)
            for k, d in zip(run.tolist(), (docs[run] - self._groups[g, 0]).tolist()):
                out[k] = values[d]
        return out

    def _group(self, g: int) -> list[str]:
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        import pyarrow.parquet as pq

        shard, rg = int(self._groups[g, 1]), int(self._groups[g, 2])
        values = pq.ParquetFile(self.files[shard]).read_row_group(rg, columns=[self.column]).column(0).to_pylist()
        self._cache[g] = values
        if len(self._cache) > self.CACHED_GROUPS:
            self._cache.popitem(last=False)
        return values

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"ShardColumn({self.column!r}, {len(self):,} documents in {len(self.files)} shard(s))"
