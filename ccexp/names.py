"""Names: made from data (a label value, a domain, a URL, any string becomes part of metric, task and
file names, so it must be safe for MLflow, lm-eval and the file system, and distinct values must stay
distinct), and a run's name made from its config ([`run_name`][ccexp.names.run_name], asking the clusterer's schema)."""
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


def metric_keys(metrics: dict[str, float]) -> dict[str, float]:
    """Make metric names MLflow-safe, part by part between the ``/``: characters outside
    ``[A-Za-z0-9_.- ]`` become ``_``, an empty or dot-only part becomes ``_empty_`` (MLflow refuses
    ``//`` and ``..``), and names that collide after that get a short hash of the original."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        parts = [re.sub(r"[^A-Za-z0-9_.\- ]", "_", part).strip() for part in name.split("/")]
        safe = "/".join(p if p.strip(".") else "_empty_" for p in parts)
        if safe != name and (safe in out or safe in metrics):
            safe = f"{safe}_{hashlib.sha256(name.encode()).hexdigest()[:6]}"
        out[safe] = value
    return out


def run_name(cfg) -> str:
    """A readable run name that starts with what usually differs inside a sweep,
    ``<sampler>-k<K>[l<level>]-s<seed>-<config hash>`` (the corpus, model and recipe are run tags),
    never MLflow's random one. The 4-hex-digit hash of the resolved config (paths and
    ``train.resume_from`` excluded) tells apart runs that differ in any other setting; reruns of one
    config share it."""
    import json

    from omegaconf import OmegaConf

    from ccexp.config import component

    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("paths", None)
    container.get("train", {}).pop("resume_from", None)
    digest = hashlib.sha256(json.dumps(container, sort_keys=True, default=str).encode()).hexdigest()[:4]
    groups = component("clusterer", cfg.clusterer).name_part(cfg.clusterer, int(cfg.sampler.level))
    return f"{cfg.sampler.name}-{groups}-s{cfg.seed}-{digest}"
