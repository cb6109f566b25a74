"""Names made from data: a label value (a domain, a URL, any string) becomes part of metric, task and
file names, so it must be safe for MLflow, lm-eval and the file system, and distinct values must stay
distinct."""
from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Iterable


def safe_names(values: Iterable[str], *, allowed: str = r"A-Za-z0-9_.\-", lower: bool = False,
               max_length: int = 80) -> dict[str, str]:
    """A distinct safe name for every distinct value.

    Characters outside ``allowed`` become ``_`` (runs of them one ``_``); leading and trailing ``.``,
    ``_`` and ``-`` are dropped (no ``..``-style path parts); an empty result becomes ``empty``. Values
    whose cleaned names coincide (``C++`` and ``C#``, ``fin`` and ``fin..``) each get a 6-hex hash of
    the original appended, so no two values share a name.

    Returns:
        value -> name, for every distinct value.
    """
    cleaned = {}
    for value in sorted(set(map(str, values))):
        text = value.lower() if lower else value
        cleaned[value] = (re.sub(rf"[^{allowed}]+", "_", text).strip("._-") or "empty")[:max_length]
    counts = Counter(cleaned.values())
    return {v: c if counts[c] == 1 else f"{c}_{hashlib.sha256(v.encode()).hexdigest()[:6]}"
            for v, c in cleaned.items()}
