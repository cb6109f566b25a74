"""The evaluation step of a run: held-out perplexity (overall, macro, worst, rare/common, per cluster,
per label) and, with ``eval.lm_eval``, lm-evaluation-harness on the trained model."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ccexp.data.corpus import Corpus
from ccexp.data.split import TrainSplit
from ccexp.data.tokenize import TokenizedCorpus
from ccexp.evaluation.perplexity import document_nll, summarize

log = logging.getLogger("ccexp")


@dataclass
class EvalResult:
    """metrics: ``ppl``, ``ppl_macro``, ... and ``lm_eval/<task>/<metric>``; per_cluster: arrays [K] of
    the held-out ``nll``, ``tokens``, ``documents`` and ``ppl``; seconds: the evaluation's time."""

    metrics: dict[str, float]
    per_cluster: dict[str, np.ndarray]
    seconds: float

    def for_mlflow(self, max_cluster_metrics: int, num_clusters: int) -> dict[str, float]:
        """``eval/*`` and ``lm_eval/*`` metrics; per-cluster ones only when K <= ``max_cluster_metrics``."""
        return {(k if k.startswith("lm_eval/") else f"eval/{k}"): v for k, v in self.metrics.items()
                if not k.startswith("ppl_cluster/") or num_clusters <= max_cluster_metrics}


def evaluate(cfg: DictConfig, model, tokenized: TokenizedCorpus, split: TrainSplit, corpus: Corpus,
             run_dir: Path) -> EvalResult:
    """Score every held-out document on its first ``eval.max_tokens`` tokens and aggregate
    (:mod:`ccexp.evaluation.perplexity`); then lm-eval when configured."""
    t0 = time.perf_counter()
    tok, held = tokenized.tokenizer, split.heldout_docs
    nll, ntok = document_nll(model, tokenized.tokens, tokenized.offsets, held, eos_id=tok.eos_token_id,
                             pad_id=tok.pad_token_id, max_tokens=cfg.eval.max_tokens, batch_size=cfg.eval.batch_size,
                             device=next(model.parameters()).device)
    held_labels = {k: [v[i] for i in held] for k, v in corpus.labels.items()}
    report = summarize(nll, ntok, split.labels[held], split.num_clusters, held_labels,
                       min_cluster_docs=cfg.eval.min_cluster_docs, sizes=split.sizes)
    metrics = dict(report.metrics)
    if cfg.eval.lm_eval is not None:
        from ccexp.evaluation.lm_eval_bridge import evaluate as lm_evaluate

        lm_metrics = lm_evaluate(cfg, model, tok, [corpus.texts[i] for i in held], held_labels, run_dir)
        metrics.update({f"lm_eval/{k}": v for k, v in lm_metrics.items()})
        log.info("lm-eval: %s", ", ".join(f"{k}={v:.3f}" for k, v in lm_metrics.items()
                                          if k.endswith(("/acc", "/word_perplexity"))))
    log.info("eval: held-out ppl %.2f, macro %.2f, worst cluster %.2f (cluster %d) over %d docs / %d tokens",
             metrics["ppl"], metrics["ppl_macro"], metrics["ppl_worst"], int(metrics["ppl_worst_cluster"]),
             int(metrics["heldout_documents"]), int(metrics["heldout_tokens"]))
    return EvalResult(metrics, report.per_cluster, time.perf_counter() - t0)
