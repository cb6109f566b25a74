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


def plot_text(value: object, width: int = 40) -> str:
    """``value`` as literal text for a matplotlib label: whitespace and control characters become
    single spaces, ``$`` is escaped (matplotlib would read ``$...$`` as mathtext: ``$x^2$`` drawn as x²,
    an unbalanced ``$`` raising), and more than ``width`` characters are cut with ``…``."""
    text = " ".join("".join(ch if ch.isprintable() else " " for ch in str(value)).split())
    if len(text) > width:
        text = text[:width - 1] + "…"
    return text.replace("$", r"\$") or "(empty)"


def markdown_cell(value: object, width: int = 160) -> str:
    """``value`` as one Markdown table cell: on one line, ``|`` escaped, cut at ``width`` characters."""
    text = " ".join(str(value).split())
    return (text[:width] + ("…" if len(text) > width else "")).replace("|", "\\|")
