"""Several corpora read as one (``data=sources``, ``data.sources=[{path, weight, name}, ...]``): each source's
documents in order, each labelled ``source`` with its name, ids prefixed with it (so an id two sources share
stays two documents), re-cut into shards of one size. The target token share of each source (``weight``)
is what [`ccexp.sampling.sources.SourceMixture`][ccexp.sampling.sources.SourceMixture] holds the training stream to."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ccexp.data.corpus import CorpusBatch
from ccexp.errors import CcexpError

SOURCE_FIELD = "source"  # the label field every document of a multi-source corpus carries
SOURCE_KEYS = ("path", "weight", "name")  # what a data.sources entry may say


def source_entries(sources: Sequence[Any]) -> list[dict]:
    """Each ``data.sources`` entry as a mapping: ``{path: ..., weight: ..., name: ...}`` as given, or a plain path
    (``data.sources=[web.jsonl,books.jsonl]``) as ``{path: <it>}``.

    Raises:
        CcexpError: for an entry that is neither (a number, a list, null), naming it and the forms it may take.
    """
    from collections.abc import Mapping

    out = []
    for i, s in enumerate(sources):
        if isinstance(s, str):
            out.append({"path": s})
        elif isinstance(s, Mapping):
            out.append(dict(s))
        else:
            shown = "null" if s is None else f"a list ({len(s)} items)" if isinstance(s, Sequence) else \
                f"{s!r}, a number" if isinstance(s, (int, float)) else f"{s!r}, a {type(s).__name__}"
            raise CcexpError(f"data.sources[{i}] is {shown}; give each source as a path or as {{path: ..., weight: "
                             "..., name: ...} (data.sources=[{path: web.jsonl, weight: 0.7}, books.jsonl])")
    return out


def source_names(sources: Sequence[Any]) -> list[str]:
    """Each source's name: its ``name``, else its file name without the data suffixes (``web.jsonl.gz`` ->
    ``web``).

    Raises:
        CcexpError: for an entry with a key other than path, weight and name (the one it most likely means is
            named), an entry without a path, or two sources of one name.
    """
    import difflib

    names = []
    for i, s in enumerate(source_entries(sources)):
        for key in s:
            if key not in SOURCE_KEYS:
                close = difflib.get_close_matches(str(key), SOURCE_KEYS, n=1, cutoff=0.6)
                raise CcexpError(f"data.sources[{i}].{key} is not a setting of a source"
                                 + (f"; did you mean '{close[0]}'?" if close else f" (use {', '.join(SOURCE_KEYS)})"))
        if not s.get("path"):
            raise CcexpError(f"data.sources[{i}] has no path; give each source as {{path: ..., weight: ...}}")
        names.append(str(s.get("name") or re.sub(r"(\.(jsonl|json|parquet|gz))+$", "", Path(str(s["path"])).name)))
        if "/" in names[-1]:  # ids are <source>/<id>: a "/" in a name could make two sources' ids one
            raise CcexpError(f"data.sources[{i}] is named {names[-1]!r}; a source name may not hold '/'")
    paths = [str(Path(str(s["path"])).expanduser().resolve()) if "://" not in str(s["path"]) else str(s["path"])
             for s in source_entries(sources)]
    for i, p in enumerate(paths):
        if paths.index(p) != i:
            raise CcexpError(f"data.sources[{i}] and data.sources[{paths.index(p)}] read the same file ({p}): its "
                             "documents would be trained on twice and held out under one source while trained on "
                             "under the other; give each file once")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CcexpError(f"data.sources: two sources are named {repeated[0]!r}; give each a distinct name "
                         f"({{path: ..., name: ...}})")
    return names


def source_weights(sources: Sequence[Any]) -> np.ndarray | None:
    """float64[S] the target token shares (normalised), or None when no source gives a weight (then the
    sources are one corpus, sampled as any other).

    Raises:
        CcexpError: for a weight that is not a finite number >= 0, weights given for some sources only,
            or weights that are all 0.
    """
    given = [s.get("weight") for s in source_entries(sources)]
    if all(w is None for w in given):
        return None
    if any(w is None for w in given):
        raise CcexpError("data.sources: give a weight for every source or for none")
    try:
        if any(isinstance(x, bool) for x in given):
            raise TypeError("a boolean is not a weight")
        w = np.array([float(x) for x in given], dtype=np.float64)
    except (TypeError, ValueError):
        raise CcexpError(f"data.sources weights {given} must be numbers") from None
    if not np.isfinite(w).all() or (w < 0).any() or w.max() <= 0:
        raise CcexpError(f"data.sources weights {given} must be finite, >= 0 and not all 0")
    w = w / w.max()  # the largest first: weights whose sum overflows (1e308 each) still normalise
    return w / w.sum()


def source_batches(readers: Iterable[tuple[str, Callable[[int], Iterator[CorpusBatch]]]],
                   documents: int) -> Iterator[CorpusBatch]:
    """The sources' documents, source after source, in batches of ``documents`` (the last may be shorter):
    each document's id becomes ``<source>/<id>`` and its labels gain ``source``.

    Args:
        readers: (name, batches) per source, ``batches(n)`` yielding that source's validated documents.
    """
    out: CorpusBatch | None = None
    for name, batches in readers:
        for batch in batches(documents):
            if out is None:
                out = CorpusBatch([], [], {**{k: [] for k in batch.labels}, SOURCE_FIELD: []},
                                  [] if batch.prompt_chars is not None else None)
            for k in range(len(batch.texts)):
                out.add(f"{name}/{batch.ids[k]}", batch.texts[k],
                        batch.prompt_chars[k] if batch.prompt_chars is not None else 0,
                        {**{f: v[k] for f, v in batch.labels.items()}, SOURCE_FIELD: name})
                if len(out.texts) == documents:
                    yield out
                    out = CorpusBatch([], [], {k: [] for k in out.labels},
                                      [] if out.prompt_chars is not None else None)
    if out is not None and out.texts:
        yield out


def source_mix(data: Any, labels: dict[str, list[str]]) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
    """The target mix of a multi-source corpus: int32[N] each corpus document's source id (from its
    ``source`` label), float64[S] the target token shares, and the S names; None when ``data.sources`` is
    not set or gives no weights (the corpus is then sampled as one)."""
    if not data.sources:
        return None
    weights = source_weights(data.sources)
    if weights is None:
        return None
    names = source_names(data.sources)
    index = {name: i for i, name in enumerate(names)}
    return np.array([index[v] for v in labels[SOURCE_FIELD]], dtype=np.int32), weights, names
