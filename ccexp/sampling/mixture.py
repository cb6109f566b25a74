"""``mixture``: train on a fixed, given mixture of clusters (DoReMi's recipe: Xie et al. 2023,
"DoReMi: Optimizing Data Mixtures Speeds Up Language Model Pretraining", §2 — learn the domain
weights with a small proxy run, then train the main model on the proxy's *average* weights).

**Unit of a weight.** By default (``weight_unit="tokens"``) a weight is the cluster's share of the
*training tokens*, as ``data.sources`` weights, OLMo-core's and Dolma's mixture ratios, DoReMi's
published domain weights (over fixed-length sequences) and UniMax's budget are. The clusters are then
interleaved by weighted fair queueing over their tokens (WF²Q, the rule and proof of
[`ccexp.sampling.sources`][ccexp.sampling.sources] with clusters for sources, [`ccexp.sampling.kernels.token_fair_documents`][ccexp.sampling.kernels.token_fair_documents]):
the next document comes from the cluster, among those not ahead of their share, whose next document
finishes first in the weighted token schedule. **Bound**: after every document, every cluster ``c``
in play holds ``|x_c − w_c · T| <= L`` tokens (``x_c`` its tokens, ``T`` all tokens, ``L`` the largest
document of a cluster in play), counted from the last change of the clusters in play (a cluster the
cap takes out, a reset); the order is deterministic given the documents, and which documents come
is the seed's (each cluster's passes over a permutation). With ``weight_unit="documents"`` a weight is
the cluster's probability per *draw* (ccexp before 2026-12-02): the cluster of each draw is i.i.d.
from ``π`` per block (a generator keyed by ``(seed, block)``), and a cluster of long documents gets
more tokens than its weight (equal weights of 0.25 gave a cluster of code 72.7 % of the tokens).

The weights (``sampler.weights``) come from a list of K numbers (cluster ids 0..K-1), a mapping
``{cluster: weight}`` (clusters it leaves out get 0), a ``.csv`` file (columns ``cluster`` and
``weight``, or ``average_weight`` as ccexp writes it), a ``.json`` file (a list or a mapping), or the
folder of an earlier ccexp run: its ``tables/clusters.csv`` column ``average_weight``, the token shares
that run *trained on* (a learning policy's averaged weights; a mixture run's realised shares, which
differ from its ``given_*`` column where a cap bound), converted to draw probabilities with this run's
mean document lengths when ``weight_unit="documents"``. A mapping's key is a cluster id when it is
an integer; a string key is first looked up among ``cluster_names`` (the clustering's names when it
has them: with ``clusterer=labels`` the sorted label values), then read as an id. A cluster without
training documents gets weight 0 (a warning names any the weights gave some).

``max_repetitions`` M: no document is drawn more than M times, ClusterClip's
[`RepetitionClip`][ccexp.sampling.clip.RepetitionClip] (a cluster leaves after ``M · n_c`` draws) — and the
others are then *re-mixed* in their given proportions, so the realised mix differs from the weights.
OLMo-core's ``max_repetition_factor`` instead refuses a mixture that would repeat a source more often;
ccexp warns before training which clusters will be clipped and records the realised shares. With
``on_exhausted=error`` a token budget above ``M ·`` the tokens of the clusters with weight is refused up
front, and a stream that runs out ends; ``reset`` starts the repetition counts again. Clusters of
weight 0 are never drawn.

A clustering of one cluster — the stand-in on which pre-flight (``clusterer=labels``, whose K is not
known before the corpus is read) and the token-budget check before the embedding build the policy —
has the one possible mix ``[1]``: there the weights' values are checked, not their count or names.
"""
from __future__ import annotations

import csv
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ccexp.data.userfiles import read_csv, read_json
from ccexp.errors import CcexpError
import ccexp.sampling.kernels as kernels
from ccexp.sampling.base import document_shares, normalised
from ccexp.sampling.clip import RepetitionClip
from ccexp.sampling.uniform import UniformSampler

log = logging.getLogger("ccexp")

_MIXTURE_STREAM = 0x4D495854  # "MIXT"
_KEY = "sampler.weights"
LEARNED = "doremi"  # sampler.weights: learned by a proxy run the training pipeline computes first


def _number(value: Any, where: str) -> float:
    """``value`` as a finite, non-negative float, or a one-line CcexpError naming ``where``."""
    if isinstance(value, bool):
        raise CcexpError(f"{_KEY}: {where} is {value!r}, not a number")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise CcexpError(f"{_KEY}: {where} is {value!r}, not a number") from None
    if math.isnan(x) or math.isinf(x):
        raise CcexpError(f"{_KEY}: {where} is {x}; every weight must be a finite number >= 0")
    if x < 0:
        raise CcexpError(f"{_KEY}: {where} is {x}; weights must be >= 0")
    return x


def _csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(header, rows) of the CSV file ``path`` ([`ccexp.data.userfiles.read_csv`][ccexp.data.userfiles.read_csv])."""
    return read_csv(path, f"{_KEY}={str(path)!r}")


def input_files(source: Any) -> list[Path]:
    """The files ``sampler.weights`` reads when it names a path: the file, or an earlier run's
    ``tables/clusters.csv``; [] for a list, a mapping or ``doremi`` (what a run's identity hashes besides its
    settings, `ccexp.names.run_identity`)."""
    if not isinstance(source, (str, Path)) or source == LEARNED:
        return []
    path = Path(source).expanduser()
    return [path / "tables" / "clusters.csv"] if path.is_dir() else [path]


def _read_csv(path: Path, columns: tuple[str, ...]) -> dict[str, str]:
    """{cluster: weight} (as strings) from ``path``'s ``cluster`` column and the first of ``columns`` it has."""
    header, rows = _csv_rows(path)
    column = next((c for c in columns if c in header), None)
    if "cluster" not in header or column is None:
        raise CcexpError(f"{_KEY}={str(path)!r} needs a 'cluster' column and a {' or '.join(map(repr, columns))} "
                         f"column; it has {header}")
    out: dict[str, str] = {}
    for row in rows:
        key = (row["cluster"] or "").strip()
        if key in out:
            raise CcexpError(f"{_KEY}={str(path)!r} lists cluster {key!r} twice")
        out[key] = row[column]
    return out


def _run_weights(folder: Path) -> dict[int, str]:
    """{cluster id: learned weight} from an earlier ccexp run's ``tables/clusters.csv``."""
    table = folder / "tables" / "clusters.csv"
    if not table.is_file():
        raise CcexpError(f"{_KEY}={str(folder)!r} is a folder without tables/clusters.csv; give the folder of an "
                         f"earlier ccexp run (outputs/runs/<date>/<run id>), a .csv or .json file, or a list")
    header, _ = _csv_rows(table)
    if "average_weight" not in header:
        name = ""
        try:
            from omegaconf import OmegaConf

            name = f" (sampler={OmegaConf.load(folder / 'resolved_config.yaml').sampler.name})"
        except Exception:  # noqa: BLE001 (the sampler's name only decorates the message)
            pass
        raise CcexpError(f"{_KEY}={str(folder)!r}: that run{name} learned no weights (its tables/clusters.csv has "
                         f"no average_weight column); give the folder of a sampler=dynamic run (ODM or DoReMi)")
    rows = _read_csv(table, ("average_weight",))
    try:
        return {int(k): v for k, v in rows.items()}
    except ValueError:
        raise CcexpError(f"{_KEY}={str(folder)!r}: tables/clusters.csv has a non-integer cluster id") from None


def _warn_if_other_clusters(folder: Path, sizes: np.ndarray) -> None:
    """Warn when an earlier run's clusters have other training sizes than this run's: its weights then belong
    to another corpus or clustering, where a cluster id names another group of documents."""
    try:
        with open(folder / "tables" / "clusters.csv", newline="") as f:
            theirs = {int(r["cluster"]): int(r["train_size"]) for r in csv.DictReader(f)}
    except (OSError, KeyError, ValueError):
        return  # _run_weights says what is wrong with the folder
    differ = sum(theirs.get(c) != int(n) for c, n in enumerate(sizes)) + sum(c >= sizes.size for c in theirs)
    if differ:
        log.warning("mixture: %d of the %d clusters of %s have other training sizes than this run's: its weights "
                    "were learned on another corpus or clustering, where a cluster id names other documents",
                    differ, max(len(theirs), int(sizes.size)), folder)


def _load(source: str | Path) -> Any:
    """The weights a path names: a run folder, a .csv or a .json file."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _run_weights(path)
    if not path.exists():
        raise CcexpError(f"{_KEY}={str(source)!r}: no such file or folder; give a list of weights, a .csv or .json "
                         f"file, or the folder of an earlier ccexp run")
    if path.suffix.lower() == ".csv":
        return _read_csv(path, ("weight", "average_weight"))
    if path.suffix.lower() == ".json":
        data = read_json(path, f"{_KEY}={str(source)!r}", "UTF-8 JSON", noun="cluster")
        if not isinstance(data, (list, dict)):
            raise CcexpError(f"{_KEY}={str(source)!r} must hold a JSON list or object of weights, "
                             f"not {type(data).__name__}")
        return data
    raise CcexpError(f"{_KEY}={str(source)!r}: read .csv and .json files and run folders only")


def _cluster_id(key: Any, num_clusters: int, names: list[str] | None) -> int:
    """A mapping key's cluster id: an integer is an id; a string a name in ``names``, else an id."""
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        cid = int(key)
    else:
        text = str(key).strip()
        if names is not None and text in names:
            return names.index(text)
        try:
            cid = int(text)
        except ValueError:
            known = (f"the clusters are {', '.join(map(repr, names[:12]))}{', ...' if len(names) > 12 else ''}"
                     if names is not None else
                     f"this clustering's clusters have no names (k-means: use ids 0..{num_clusters - 1}, or a list)")
            raise CcexpError(f"{_KEY}: unknown cluster {text!r}; {known}") from None
    if not 0 <= cid < num_clusters:
        raise CcexpError(f"{_KEY}: cluster {cid} is not a cluster id of this clustering (0..{num_clusters - 1})")
    return cid


def mixture_weights(weights: Any, sizes: np.ndarray, cluster_names: list[str] | None = None) -> np.ndarray:
    """float64[K]: the given weights, normalised over the clusters with training documents.

    Args:
        weights: a list of K numbers, a mapping {cluster name or id: weight}, or a path (str or Path) to
            a .csv, a .json or an earlier run's folder (see the module docstring).
        sizes: int64[K] training documents per cluster.
        cluster_names: the clusters' names (K strings), when the clustering has them.

    Raises:
        CcexpError: one line naming ``sampler.weights``, for a wrong count, a negative, NaN or infinite
            weight, all weights zero (or only on empty clusters), an unknown cluster, or an unreadable
            source.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    k = int(sizes.size)
    if cluster_names is not None:
        cluster_names = [str(n) for n in cluster_names]
        if len(cluster_names) != k:
            raise CcexpError(f"sampler: {len(cluster_names)} cluster names for {k} clusters")
    if isinstance(weights, str) and weights == LEARNED:
        raise CcexpError(f"{_KEY}={LEARNED} is learned by a training run's proxy stage (python -m ccexp: DoReMi's "
                         "proxy run first); here give a list, a .csv or .json file, or the folder of the run that "
                         "trained on them")
    if isinstance(weights, (str, Path)):
        weights = _load(weights)
    if isinstance(weights, np.ndarray):
        weights = weights.tolist()
    if isinstance(weights, Mapping):
        if not weights:
            raise CcexpError(f"{_KEY} is an empty mapping; give a weight for at least one cluster")
        values = {key: _number(v, f"the weight of cluster {key!r}") for key, v in weights.items()}
        if k == 1:  # the one-cluster stand-in (see the module docstring)
            return _check_total(np.array([sum(values.values())]), sizes)
        w, seen = np.zeros(k), {}
        for key, v in values.items():
            cid = _cluster_id(key, k, cluster_names)
            if cid in seen:
                raise CcexpError(f"{_KEY}: cluster {cid} is given twice (as {seen[cid]!r} and {key!r})")
            seen[cid], w[cid] = key, v
        left_out = [(cluster_names[c] if cluster_names else str(c)) for c in np.flatnonzero(w == 0) if sizes[c]]
        if left_out:
            log.info("mixture: clusters without weight (never drawn): %s", ", ".join(left_out[:20]))
    elif isinstance(weights, (list, tuple)):
        w = np.array([_number(v, f"weight {i}") for i, v in enumerate(weights)], dtype=np.float64)
        if k == 1:  # the one-cluster stand-in
            return _check_total(np.array([w.sum()]) if w.size else w, sizes)
        if w.size != k:
            raise CcexpError(f"{_KEY} has {w.size} weights but the clustering has {k} clusters; give one weight per "
                             f"cluster (ids 0..{k - 1}) or a mapping {{cluster: weight}}")
    else:
        raise CcexpError(f"{_KEY}={weights!r}: give a list of weights, a mapping {{cluster: weight}}, a .csv or .json "
                         f"file, or the folder of an earlier ccexp run")
    return _check_total(w, sizes, cluster_names)


def _check_total(w: np.ndarray, sizes: np.ndarray, names: list[str] | None = None) -> np.ndarray:
    """Zero the weight of empty clusters (warning when some was given) and normalise."""
    if w.size == 0 or not w.max() > 0:
        raise CcexpError(f"{_KEY}: every weight is 0; give at least one cluster a positive weight")
    empty = (sizes == 0) & (w > 0)
    if empty.any():
        which = ", ".join((names[c] if names else str(c)) for c in np.flatnonzero(empty)[:20])
        if not (w * (sizes > 0)).max() > 0:
            raise CcexpError(f"{_KEY}: all the weight is on clusters without training documents ({which})")
        dropped = normalised(w)[empty].sum()
        log.warning("mixture: clusters %s have no training documents; their weight (%.3g of the total) is dropped",
                    which, float(dropped))
        w = np.where(sizes > 0, w, 0.0)
    return normalised(w)


class MixtureSampler(UniformSampler):
    """Clusters i.i.d. from given weights, documents by passes, an optional repetition cap; see the
    module docstring and [`Sampler`][ccexp.sampling.base.Sampler] for the shared arguments
    (``labels`` int32[N], ``sizes`` int64[K], ``block_size``, ``seed``, ``document_tokens`` int64[N],
    ``token_budget``).

    Args:
        weights: the mixture — a list of K numbers >= 0, a mapping {cluster name or id: weight}, or a
            path (str) to a .csv, a .json or an earlier ccexp run's folder; normalised.
        cluster_names: a runtime input, the clustering's K cluster names when it has them (label
            values with ``clusterer=labels``); None for k-means, whose mapping keys must be ids.
        weight_unit: ``"tokens"`` (a weight is the cluster's share of the training tokens) or
            ``"documents"`` (its probability per draw).
        max_repetitions: M >= 1, the most times a document is drawn (the other clusters are then
            re-mixed), or None for no cap.
        on_exhausted: ``"error"`` (a budget above the cap's supply is refused; an exhausted stream
            ends) or ``"reset"`` (the repetition counts start again).

    Raises:
        CcexpError: one line for bad weights (naming ``sampler.weights``), M < 1, an unknown
            ``on_exhausted`` or ``weight_unit``, or a token budget the cap cannot supply.
    """

    name = "mixture"

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None, weights: Any = None,
                 cluster_names: list[str] | None = None, weight_unit: str = "tokens",
                 max_repetitions: int | None = None, on_exhausted: str = "error"):
        if weights is None:
            raise CcexpError(f"{_KEY} is required: a list of weights, a mapping {{cluster: weight}}, a .csv or .json "
                             f"file, or the folder of an earlier ccexp run")
        if on_exhausted not in ("error", "reset"):
            raise CcexpError(f"sampler.on_exhausted={on_exhausted!r} is not an option; use 'error' or 'reset'")
        if weight_unit not in ("tokens", "documents"):
            raise CcexpError(f"sampler.weight_unit={weight_unit!r} is not an option; use 'tokens' (a weight is the "
                             f"cluster's share of the training tokens) or 'documents' (its share of the draws)")
        clip = (None if max_repetitions is None else
                RepetitionClip(np.asarray(sizes), max_repetitions, on_exhausted, setting="sampler.max_repetitions"))
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget, clip=clip)
        self.max_repetitions = None if clip is None else clip.threshold
        self.weight_unit = weight_unit
        from_run = isinstance(weights, (str, Path)) and Path(weights).expanduser().is_dir()
        self._pi = mixture_weights(weights, self.sizes, cluster_names)
        if from_run and self.document_tokens is not None and self.num_clusters > 1:
            # only a sampler over the real training documents (they have lengths) compares clusterings: pre-flight's
            # stand-in (one document per cluster, no lengths) would call every run folder another clustering
            _warn_if_other_clusters(Path(weights).expanduser(), self.sizes)
        if from_run and weight_unit == "documents":  # a run folder holds token shares
            self._pi = document_shares(self._pi, self.mean_document_tokens())
        self._tokens = (self.document_tokens if self.document_tokens is not None
                        else np.ones(self.num_documents, np.int64))
        self._taken = np.zeros(self.num_clusters, np.int64)  # tokens per cluster since the clusters in play changed
        self._in_play = self._pi > 0
        if clip is not None:
            self._check_supply()

    def _check_supply(self) -> None:
        """Refuse a budget above ``M ·`` the tokens of the clusters with weight (``on_exhausted=error``);
        warn when clusters will be clipped before the run ends (the mix then drifts from the weights)."""
        if self.token_budget is None:
            return
        tokens = (self.document_tokens if self.document_tokens is not None
                  else np.ones(self.num_documents, np.int64))
        cluster_tokens = np.bincount(self.labels, weights=tokens, minlength=self.num_clusters)
        m, drawn = self.clip.threshold, self._pi > 0
        supply = m * int(cluster_tokens[drawn].sum())
        if self.clip.ends_stream and self.token_budget > supply:
            docs = int(self.sizes[drawn].sum())
            raise CcexpError(f"sampler.max_repetitions={m} allows at most {m * docs:,} document draws = {supply:,} "
                             f"tokens from the {docs:,} training documents of the clusters with weight; the run needs "
                             f"{self.token_budget:,} tokens; raise sampler.max_repetitions, lower train.steps or "
                             f"train.tokens_per_step, or set sampler.on_exhausted=reset")
        if self.weight_unit == "tokens":
            short = np.flatnonzero(self._pi * self.token_budget > m * cluster_tokens)
        else:
            mean = self.mean_document_tokens()
            draws = self.token_budget / float((self._pi * mean).sum())  # expected documents of the run
            short = np.flatnonzero(self._pi * draws > m * self.sizes)
        if short.size:
            log.warning("mixture: at these weights clusters %s need more than sampler.max_repetitions=%d passes; "
                        "they will be clipped and the rest of the run drawn from the others in their proportions",
                        ", ".join(map(str, short[:20])), m)

    def weights(self) -> np.ndarray:
        """float64[K]: the given mix, normalised, in [`weight_unit`][ccexp.sampling.mixture.MixtureSampler.weight_unit] (token shares by default)."""
        return self._pi.copy()

    def given_weights(self) -> np.ndarray:
        """float64[K]: the given mix, normalised, in [`weight_unit`][ccexp.sampling.mixture.MixtureSampler.weight_unit]. A run's table writes it beside
        the realised token shares, which are what a later run reuses (see the module docstring)."""
        return self._pi.copy()

    def notes(self) -> list[tuple[int, str]]:
        """The mixture the run trains on (the largest weights first)."""
        order = np.argsort(-self._pi, kind="stable")[:8]
        shown = ", ".join(f"{c}: {self._pi[c]:.3f}" for c in order if self._pi[c] > 0)
        unit = "token shares" if self.weight_unit == "tokens" else "draw probabilities (sampler.weight_unit=documents)"
        return [(logging.INFO, f"mixture: cluster weights as {unit} {shown}{' ...' if self.num_clusters > 8 else ''} "
                               f"({int(np.count_nonzero(self._pi))} of {self.num_clusters} clusters drawn)")]

    def _quota(self, exposure: np.ndarray) -> np.ndarray | None:
        quota = super()._quota(exposure)
        return None if quota is None else np.where(self._pi > 0, quota, 0)  # weight 0: never drawn

    def _draw(self, lane: int) -> np.ndarray:
        if self.weight_unit == "documents":
            rng = np.random.default_rng([self.seed, _MIXTURE_STREAM, self._blocks])
            return self._iid_documents(rng, self._pi, self.block_size)
        return self._token_fair_documents(self.block_size)

    def _token_fair_documents(self, count: int) -> np.ndarray:
        """int64[c] the next ``count`` documents of the token-share schedule (``c < count`` as in
        [`_iid_documents`][ccexp.sampling.mixture.MixtureSampler._iid_documents]); ``self._exposure`` is advanced."""
        docs = np.empty(count, np.int64)
        got = 0
        big = np.iinfo(np.int64).max // 4
        while got < count:
            quota = self._quota(self._exposure)
            quota = np.where(self._pi > 0, big, 0) if quota is None else np.where(self._pi > 0, quota, 0)
            in_play = (quota > 0) & (self.sizes > 0)
            if not in_play.any():
                if got and self._stops_when_exhausted():
                    break  # a short last block; the next draw raises
                self._on_no_active_cluster()  # raises, or resets the clip counters
                continue
            if not np.array_equal(in_play, self._in_play):  # the cap took a cluster out, or a reset: re-mix
                self._in_play, self._taken[:] = in_play, 0
            got += kernels.token_fair_documents(normalised(np.where(in_play, self._pi, 0.0)), self._taken, self._exposure, quota, self.sizes,
                                                self._starts, self._members, self._tokens, self._pass_key,
                                                docs[got:])
        return docs[:got]

    def active_clusters(self) -> int:
        quota = self._quota(self._exposure)
        return int(np.count_nonzero(self._pi > 0 if quota is None else quota > 0))

    def clipped(self) -> np.ndarray:
        return super().clipped() & (self._pi > 0)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mixture_weights": self._pi.copy(), "weight_unit": self.weight_unit,
                "taken": self._taken.copy(), "in_play": self._in_play.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore [`state_dict`][ccexp.sampling.mixture.MixtureSampler.state_dict].

        Raises:
            CcexpError: if the state was saved with other weights.
        """
        saved = state.get("mixture_weights")
        if saved is not None and (len(saved) != self.num_clusters or not np.allclose(saved, self._pi, atol=1e-12)):
            raise CcexpError("sampler state was saved with other sampler.weights; resume with the same weights")
        if state.get("weight_unit", "documents") != self.weight_unit:
            raise CcexpError(f"sampler state was saved with sampler.weight_unit={state.get('weight_unit', 'documents')}; "
                             f"resume with the same unit")
        super().load_state_dict(state)
        self._taken = np.asarray(state.get("taken", np.zeros(self.num_clusters)), dtype=np.int64).copy()
        self._in_play = np.asarray(state.get("in_play", self._pi > 0), dtype=bool).copy()
