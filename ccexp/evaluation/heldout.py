"""The evaluation step of a run: held-out perplexity (overall, macro, worst, rare/common, per cluster,
per label) and, with ``eval.lm_eval``, lm-evaluation-harness on the trained model.

Each part runs on its own ([`isolated`][ccexp.evaluation.heldout.isolated]): a part that fails is reported in one line (the run's
``errors``, logged as a warning and an ``eval_error/<part>`` tag; the traceback goes to
``<run>/eval_errors.log``) and the other parts, the training metrics and the checkpoint are kept.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ccexp.data.corpus import Corpus, take
from ccexp.data.split import TrainSplit
from ccexp.data.tokenize import TokenizedCorpus
from ccexp.evaluation.perplexity import document_nll, scored_bytes, summarize

log = logging.getLogger("ccexp")


@dataclass
class EvalResult:
    """metrics: ``ppl``, ``ppl_macro``, ... and ``lm_eval/<task>/<metric>``; per_cluster: arrays [K] of
    the held-out ``nll``, ``tokens``, ``documents`` and ``ppl`` (NaN when that part failed); seconds:
    the evaluation's time; errors: part -> the one line of a part that failed; per_document: arrays [n]
    of every held-out document's ``document``, ``cluster``, ``tokens``, ``bytes`` and ``nll`` (None
    when the held-out part failed)."""

    metrics: dict[str, float]
    per_cluster: dict[str, np.ndarray]
    seconds: float
    errors: dict[str, str]
    per_document: dict[str, np.ndarray] | None = None

    def for_mlflow(self, max_cluster_metrics: int, num_clusters: int) -> dict[str, float]:
        """``eval/*`` and ``lm_eval/*`` metrics (per-cluster ones only when K <= ``max_cluster_metrics``), and
        the headline figures again, rounded (bits per byte to 4 decimals, perplexities to 2), under [`HEADLINE_KEYS`][ccexp.evaluation.heldout.HEADLINE_KEYS]'s
        short names (``bpb``, ``macro ppl``, ``ppl``, ...): what MLflow's runs table shows first (ccexp.ui), readable
        at a glance and sorting in the order they matter."""
        out = {(k if k.startswith("lm_eval/") else f"eval/{k}"): v for k, v in self.metrics.items()
               if not k.startswith("ppl_cluster/") or num_clusters <= max_cluster_metrics}
        out.update({HEADLINE_KEYS[k]: round(float(self.metrics[k]), 4 if k == "bpb" else 2) for k in HEADLINE_KEYS
                    if k in self.metrics and np.isfinite(self.metrics[k])})
        return out


# the headline figures as MLflow's runs table shows them (rounded copies of eval/<name>; MLflow orders metric columns
# by name, and these names sort in the order they matter: bits per byte, the comparison's question, first); a sweep
# adds three paired differences against its baseline (ccexp.launch.sweep), "bpb vs <baseline> pct", "macro vs
# <baseline> pct" and "ppl vs <baseline> pct" (ccexp.compare.report.headline_differences), each sorting right after its
# figure, with "... pct ci" (their 95 % CI half-width) after them
HEADLINE_KEYS = {"bpb": "bpb", "ppl_macro": "macro ppl", "ppl": "ppl", "ppl_rare": "rare ppl", "ppl_worst": "worst ppl"}
DIFFERENCE_KEYS = {"bpb": "bpb vs {baseline} pct", "ppl_macro": "macro vs {baseline} pct", "ppl": "ppl vs {baseline} pct"}


def is_headline_key(key: str) -> bool:
    """True for the MLflow names of [`HEADLINE_KEYS`][ccexp.evaluation.heldout.HEADLINE_KEYS] and of the sweep's
    differences ([`DIFFERENCE_KEYS`][ccexp.evaluation.heldout.DIFFERENCE_KEYS]) with their CI half-widths (``... pct ci``)."""
    return key in HEADLINE_KEYS.values() or ("/" not in key and key.endswith((" pct", " pct ci"))
                                            and key.split(" vs ")[0] in ("bpb", "macro", "ppl"))


def isolated(part: str, errors: dict[str, str], run_dir: Path, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None when it raises: the error becomes ``errors[part]`` (one line),
    a warning, and a traceback in ``<run_dir>/eval_errors.log``."""
    import traceback

    try:
        return fn(*args, **kwargs)
    except Exception as e:  # a failing evaluation part must not lose the others or the trained model
        errors[part] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        log.warning("eval: %s failed (%s); the other parts and the checkpoint are kept, traceback in %s", part,
                    errors[part], run_dir / "eval_errors.log")
        with open(run_dir / "eval_errors.log", "a") as f:
            f.write(f"--- {part}\n{traceback.format_exc()}\n")
        return None


WEIGHTS_NAMED = {"ema": "EMA weights", "tail": "tail-averaged weights"}  # eval.average -> the weights, in log lines
# the final weights' figures logged beside the averaged weights' headline (eval/final/<name>)
FINAL_METRICS = ("ppl", "ppl_macro", "ppl_worst", "ppl_rare", "ppl_common", "bpb", "bpb_macro")


def evaluate(settings: DictConfig, model, tokenized: TokenizedCorpus, split: TrainSplit, corpus: Corpus,
             run_dir: Path, average=None, ranks: tuple[int, int] = (0, 1), lm_model=None, mark=None) -> EvalResult:
    """Score every held-out document on its first ``eval.max_tokens`` tokens (``settings``: the ``eval``
    option) and aggregate
    ([`ccexp.evaluation.perplexity`][ccexp.evaluation.perplexity]); then lm-eval when configured. Each part is [`isolated`][ccexp.evaluation.heldout.isolated].

    ``average`` (the averaged weights of ``eval.average``, or None): the headline metrics and lm-eval
    are scored on it, and ``model``'s (the final weights') summary is kept as ``final/<name>``.
    ``ranks`` (rank 0, world size): ``model`` is sharded over that many ranks, which score their shares of the
    held-out documents together (the others call [`heldout_share`][ccexp.evaluation.heldout.heldout_share]).
    ``lm_model``: a function returning the model lm-eval scores whole (None: ``model``, or ``average``).
    ``mark``: called with ``"eval"`` once the held-out parts are done and ``"lm_eval"`` after lm-eval (the run's
    [`ccexp.runtime.Phases.mark`][ccexp.runtime.Phases.mark]: each part's time and memory peak)."""
    t0 = time.perf_counter()
    errors: dict[str, str] = {}
    held = split.heldout_docs
    held_labels = {k: take(v, held) for k, v in corpus.labels.items()}
    nbytes = isolated("bytes", errors, run_dir, scored_bytes, tokenized.tokenizer, tokenized.tokens, tokenized.offsets,
                      held, settings.max_tokens, tokenized.prompt_tokens)
    names = label_names(corpus.labels)
    report = isolated("heldout", errors, run_dir, heldout_perplexity, settings, model if average is None else average,
                      tokenized, split, held_labels, names, nbytes, ranks=ranks)
    metrics = dict(report.metrics) if report else {}
    if average is not None:
        final = isolated("heldout_final", errors, run_dir, heldout_perplexity, settings, model, tokenized, split,
                         held_labels, names, nbytes, "final weights")
        metrics.update({f"final/{k}": v for k, v in (final.metrics if final else {}).items() if k in FINAL_METRICS})
        model = average
    metrics.update(label_document_counts(corpus.labels, held_labels))
    nan = np.full(split.num_clusters, np.nan)
    per_cluster = report.per_cluster if report else {"nll": nan, "tokens": np.zeros_like(nan),
                                                     "documents": np.zeros(split.num_clusters, np.int64), "ppl": nan}
    mark = mark or (lambda phase: None)
    mark("eval")
    if settings.lm_eval is not None and not settings.lm_eval.local_tasks and not settings.lm_eval.tasks:
        log.info("lm-eval: no task (eval.lm_eval.local_tasks=false and eval.lm_eval.tasks=[]): nothing to score")
    elif settings.lm_eval is not None:
        from ccexp.evaluation.lm_eval_bridge import evaluate as lm_evaluate

        whole = isolated("lm_eval", errors, run_dir, lm_model) if lm_model is not None else model
        if average is not None:
            log.info("lm-eval: scoring the %s, as the headline held-out metrics",
                     WEIGHTS_NAMED.get(settings.average, "averaged weights"))
        lm_metrics = {}
        if whole is not None:  # None: loading the whole model failed (an lm_eval error already)
            lm_metrics = isolated("lm_eval", errors, run_dir, lm_evaluate, settings.lm_eval, whole, tokenized.tokenizer,
                                  take(corpus.texts, held), held_labels, run_dir, errors) or {}
        metrics.update({f"lm_eval/{k}": v for k, v in lm_metrics.items()})
        shown = [f"{k}={v:.3f}" for k, v in lm_metrics.items() if k.endswith(("/acc", "/word_perplexity"))]
        if shown:
            log.info("lm-eval: %s", ", ".join(shown))
        mark("lm_eval")
    return EvalResult(metrics, per_cluster, time.perf_counter() - t0, errors, report.per_document if report else None)


def heldout_share(settings: DictConfig, fit, tokenized: TokenizedCorpus, split: TrainSplit) -> dict[str, float]:
    """What a rank other than 0 does after training: under FSDP (``fit.sharded``, a
    [`ccexp.training.runner.FitResult`][ccexp.training.runner.FitResult]) its share of the held-out scoring that rank 0
    runs in [`evaluate`][ccexp.evaluation.heldout.evaluate] (every rank takes part in every forward pass); nothing
    otherwise. Returns ``{}``: the metrics are rank 0's."""
    if fit.sharded:
        heldout_nll(settings, fit.model, tokenized, split, fit.ranks)
    return {}


def heldout_nll(settings: DictConfig, model, tokenized: TokenizedCorpus, split: TrainSplit,
                ranks: tuple[int, int] = (0, 1)) -> tuple[np.ndarray, np.ndarray]:
    """Every held-out document's summed NLL (float64[n], nats) and scored tokens (int64[n]) with the ``eval`` option's
    ``settings``; with ``ranks`` = (rank, world size) of a sharded model, this rank scores its share and every rank
    gets the sums ([`ccexp.evaluation.perplexity.document_nll`][ccexp.evaluation.perplexity.document_nll])."""
    tok = tokenized.tokenizer
    return document_nll(model, tokenized.tokens, tokenized.offsets, split.heldout_docs, eos_id=tokenized.separator_id,
                        prompt_tokens=tokenized.prompt_tokens, pad_id=tok.pad_token_id, max_tokens=settings.max_tokens,
                        batch_size=settings.batch_size, device=next(model.parameters()).device, ranks=ranks)


def heldout_perplexity(settings: DictConfig, model, tokenized: TokenizedCorpus, split: TrainSplit,
                       held_labels: dict[str, list[str]], names: dict[str, dict[str, str]] | None = None,
                       nbytes: np.ndarray | None = None, weights: str | None = None, ranks: tuple[int, int] = (0, 1)):
    """Held-out perplexity overall, per cluster and per label, and bits per byte when ``nbytes``
    (int64[n], the scored bytes of each held-out document) is given (`PerplexityReport`), with the
    ``eval`` option's ``settings``; ``weights`` names the weights in the log line (default: ``eval.average``'s);
    ``ranks``: see [`heldout_nll`][ccexp.evaluation.heldout.heldout_nll]."""
    held = split.heldout_docs
    nll, ntok = heldout_nll(settings, model, tokenized, split, ranks)
    report = summarize(nll, ntok, split.labels[held], split.num_clusters, held_labels,
                       min_cluster_docs=settings.min_cluster_docs, sizes=split.sizes, label_names=names,
                       nbytes=nbytes)
    report.per_document = {"document": held, "cluster": split.labels[held], "tokens": ntok,
                           "bytes": nbytes if nbytes is not None else np.zeros_like(ntok), "nll": nll}
    m = report.metrics
    weights = weights or WEIGHTS_NAMED.get(settings.average, "final weights")
    log.info("eval (%s): held-out ppl %.2f, macro %.2f, worst cluster %.2f (cluster %d), %.4f bits/byte over %d docs "
             "/ %d tokens", weights, m["ppl"], m["ppl_macro"], m["ppl_worst"], int(m.get("ppl_worst_cluster", -1)),
             m.get("bpb", float("nan")), int(m["heldout_documents"]), int(m["heldout_tokens"]))
    return report


def label_names(labels: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """label -> (value -> the name its metrics carry), over every value of the corpus
    ([`ccexp.names.safe_names`][ccexp.names.safe_names])."""
    from ccexp.names import safe_names

    return {label: safe_names(values) for label, values in labels.items()}


def label_document_counts(labels: dict[str, list[str]], held_labels: dict[str, list[str]]) -> dict[str, float]:
    """``heldout_docs_<label>/<name>``: held-out documents of every value the corpus has (0 included),
    named as the per-label perplexities are, so a report can say "no held-out documents" for a value
    instead of dropping it."""
    from collections import Counter

    out = {}
    for label, names in label_names(labels).items():
        held = Counter(map(str, held_labels.get(label, [])))
        out.update({f"heldout_docs_{label}/{names[v]}": float(held.get(v, 0)) for v in names})
    return out
