"""Names: made from data (a label value, a domain, a URL, any string becomes part of metric, task and
file names, so it must be safe for MLflow, lm-eval and the file system, and distinct values must stay
distinct), and a run's name made from its config ([`run_name`][ccexp.names.run_name], asking the clusterer's schema)."""
from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
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


# settings that change nothing a run computes: where it writes and records (its folders, the MLflow store and
# experiment, extra loggers), what it continues from, how it is shown (the progress bar, how often a line is logged),
# how often it saves a checkpoint (a resume continues exactly), how many of the machine's cores it uses
# (hydra/launcher=packed writes trainer.threads into each job), a profiler, and what only other commands read (the
# report's and the plan's settings, a recipe's note, how many per-cluster metrics go to MLflow). Two runs that
# differ only in them are one configuration: the same run identity, and one arm of a comparison
NOT_COMPUTED = ("paths", "logger", "train.resume_from", "report", "plan", "recipe_note", "trainer.enable_progress_bar",
                "trainer.threads", "trainer.profiler", "train.log_every_n_steps", "train.checkpoint_every_n_steps",
                "eval.max_cluster_metrics")
IDENTITY_EXCLUDED = NOT_COMPUTED  # (the name the identity's docstrings use)


def _absolute_paths(node, cwd):
    """``node`` with every path (a string with a separator or a file suffix) that names an existing file or folder
    (from ``cwd``) made absolute and resolved (``..``, ``//``, symbolic links): a setting that reads a file
    (``data.path``, a weights file, a model folder) names the same input however it was written, and two relative
    ones from different folders name different inputs."""
    if isinstance(node, dict):
        return {k: _absolute_paths(v, cwd) for k, v in node.items()}
    if isinstance(node, list):
        return [_absolute_paths(v, cwd) for v in node]
    if isinstance(node, str) and ("/" in node or Path(node).suffix) and "://" not in node and len(node) < 4096:
        try:  # a path (a separator or a file suffix: "random" is a setting, not the file of that name here)
            return str((cwd / node).resolve(strict=True))  # "..", "//" and symbolic links resolved
        except (OSError, ValueError, RuntimeError):
            return node
    return node


def config_identity(container: dict) -> str:
    """The full SHA-256 (64 hex digits) of a resolved config as a plain mapping, without the settings of
    [`NOT_COMPUTED`][ccexp.names.NOT_COMPUTED] and with relative paths to existing files made absolute (from the
    working folder): two runs are the same configuration exactly when their
    identities are equal (never a short name hash: 4 hex digits are 65,536 names, and a sweep of a few hundred runs has
    even odds of sharing one). The container is not changed."""
    import copy
    import json
    from pathlib import Path

    container = copy.deepcopy(container)
    for dotted in IDENTITY_EXCLUDED:
        *parents, leaf = dotted.split(".")
        node = container
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    container = _absolute_paths(container, Path.cwd())
    return hashlib.sha256(json.dumps(container, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class RunIdentity:
    """A configuration's ``digest`` ([`config_identity`][ccexp.names.config_identity]) and its readable ``name``
    ([`run_name`][ccexp.names.run_name]), which starts with the digest's first 4 hex digits and is lengthened when
    another configuration already holds the name ([`distinct`][ccexp.names.RunIdentity.distinct])."""

    name: str
    digest: str

    def distinct(self, taken: set[str]) -> "RunIdentity":
        """This identity with a name none of ``taken`` (names held by other configurations) has: more of the digest
        in the name's last part, 8 hex digits, then 12, ... (the same configuration always lengthens alike)."""
        base, short = self.name.rsplit("-", 1)
        digits = len(short)
        name = self.name
        while name in taken and digits < len(self.digest):
            digits += 4
            name = f"{base}-{self.digest[:digits]}"
        return RunIdentity(name, self.digest)


def run_identity(cfg) -> RunIdentity:
    """``cfg``'s [`RunIdentity`][ccexp.names.RunIdentity]: its full digest (its settings and the bytes of the files
    its sampler reads, a weights or losses file rewritten in place being another configuration; the corpus and the
    model are the stages' fingerprints) and its readable name."""
    from omegaconf import OmegaConf

    from ccexp.config import component

    container = OmegaConf.to_container(cfg, resolve=True)
    files = component("sampler", cfg.sampler).input_files(cfg.sampler)
    if files:  # absent when none: the digests of runs without such files are as before
        container["sampler_input_bytes"] = {str(p): _file_digest(p) for p in files}
    digest = config_identity(container)
    return RunIdentity(run_name(cfg, digest), digest)


def _file_digest(path) -> str:
    """SHA-256 of a file's bytes ('' when it cannot be read: the run itself says why, in one line)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return ""
    return h.hexdigest()


def run_name(cfg, digest: str | None = None) -> str:
    """A readable run name that starts with what usually differs inside a sweep,
    ``<sampler>-k<K>[l<level>]-s<seed>-<4 hex digits>`` (the corpus, model and recipe are run tags),
    never MLflow's random one. The 4 hex digits are the start of the config's full digest
    ([`config_identity`][ccexp.names.config_identity], paths and ``train.resume_from`` excluded): a name for people,
    not an identity (two configurations can share it: [`RunIdentity`][ccexp.names.RunIdentity] tells them apart)."""
    from omegaconf import OmegaConf

    from ccexp.config import component

    if digest is None:
        digest = config_identity(OmegaConf.to_container(cfg, resolve=True))
    groups = component("clusterer", cfg.clusterer).name_part(cfg.clusterer, int(cfg.sampler.level))
    return f"{cfg.sampler.name}-{groups}-s{cfg.seed}-{digest[:4]}"
