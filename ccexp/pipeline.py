"""One ccexp run, top to bottom: corpus -> embed -> cluster -> tokenize -> sample + train -> evaluate -> MLflow.

The preprocessing stages are cached by content (:mod:`ccexp.stages`), so a sweep over samplers or
models embeds and clusters once.
"""
from __future__ import annotations

import csv
import logging
import os
import time
import warnings
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ccexp import stages
from ccexp.artifacts import StageStore
from ccexp.build import build, check_buildable
from ccexp.validate import check_config, check_sampler_options
from ccexp.data.packing import TokenStream, stream_lengths
from ccexp.data.tokenize import load_tokenizer
from ccexp.evaluation.perplexity import document_nll, summarize
from ccexp.tracking.mlflow_run import flatten, make_logger, metric_keys, run_name
from ccexp.training import runner

log = logging.getLogger("ccexp")


def run(cfg: DictConfig, run_dir: Path) -> dict[str, float]:
    """Run the experiment described by ``cfg``; return the evaluation metrics (rank 0)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import lightning as L

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # print once, through Hydra's handlers
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # it logs each CPU variant it tries
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "Tip:" not in r.getMessage())
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")  # Lightning's own use of a torch deprecation

    t_start = time.perf_counter()
    check_config(cfg)  # fail on a bad setting before any work
    for group in ("embedder", "clusterer", "sampler", "model"):
        check_buildable(cfg[group], group)
    check_sampler_options(cfg)
    build(cfg.clusterer, "clusterer")  # its constructor checks its options
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    outputs = Path(cfg.paths.outputs).resolve()
    store = StageStore(Path(cfg.paths.cache).resolve())

    # 1. preprocessing (cached)
    corpus_stage = stages.run_corpus(cfg, store)
    embed_stage = stages.run_embed(cfg, store, corpus_stage)
    cluster_stage = stages.run_cluster(cfg, store, corpus_stage, embed_stage)
    tokenize_stage = stages.run_tokenize(cfg, store, corpus_stage)
    corpus = stages.load_corpus(corpus_stage)
    labels, similarity = stages.load_level(cluster_stage, cfg.sampler.level)
    tokens = np.load(tokenize_stage.path / "tokens.npy", mmap_mode="r")
    offsets = np.load(tokenize_stage.path / "offsets.npy")
    tok = load_tokenizer(tokenize_stage.path / "tokenizer")
    train_docs = np.flatnonzero(~corpus.heldout)
    if (cluster_stage.path / "selected.npy").is_file():  # a curation step kept a balanced subset
        train_docs = np.flatnonzero(np.load(cluster_stage.path / "selected.npy"))
    heldout_docs = np.flatnonzero(corpus.heldout)
    sizes = np.bincount(labels[train_docs], minlength=cluster_stage.figures["levels"][cfg.sampler.level]).astype(np.int64)

    # 2. sampler, token stream, model, training
    doc_tokens = offsets[train_docs + 1] - offsets[train_docs]
    stream_len = stream_lengths(doc_tokens, cfg.train.max_doc_tokens)
    sampler = runner.make_sampler(cfg, labels[train_docs], sizes, similarity[train_docs], stream_len)
    stream = TokenStream(sampler, doc_tokens, seq_len=cfg.train.seq_len,
                         rows_per_step=cfg.train.tokens_per_step // cfg.train.seq_len,
                         max_doc_tokens=cfg.train.max_doc_tokens)
    t = cfg.train
    budget, split_tokens = t.steps * t.tokens_per_step, int(stream_len.sum())
    log.info("train: %d steps x %s tokens = %s tokens (%.2f passes over the %s tokens of %s training documents); "
             "a step is %d rows of %d tokens, %d micro-batch(es) of %d rows per rank", t.steps, f"{t.tokens_per_step:,}",
             f"{budget:,}", budget / max(1, split_tokens), f"{split_tokens:,}", f"{train_docs.size:,}",
             stream.rows_per_step, t.seq_len, t.grad_accumulation, t.micro_batch_size)
    model = runner.make_model(cfg, tok)
    logger = make_logger(cfg, outputs, tags={"sampler": cfg.sampler.name, "model": cfg.model.name,
                                             "data": cfg.data.name, "run_dir": str(run_dir)})
    if logger is not None:
        logger.log_hyperparams(flatten(cfg))
        log.info("mlflow: run %r (%s) in %s", run_name(cfg), logger.run_id, logger._tracking_uri)
    try:
        return _train_evaluate_log(cfg, run_dir, logger, stream, model, corpus, labels, sizes, tokens, offsets, tok,
                                   train_docs, heldout_docs, (corpus_stage, embed_stage, cluster_stage, tokenize_stage),
                                   t_start)
    except BaseException:
        if logger is not None:  # Lightning marks the run FINISHED after fit; an error after that must show
            logger.experiment.set_terminated(logger.run_id, "FAILED")
        raise


def _curve_callback(cfg, tokens, offsets, tok, heldout_docs, labels, sizes, corpus):
    """The held-out curve: a fixed sample of held-out documents (the same for every run on this
    corpus: drawn with a constant seed, not the run's) scored every ``eval.every_n_steps`` steps."""
    if not cfg.eval.every_n_steps:
        return []
    sample = np.sort(np.random.default_rng(0).permutation(heldout_docs)[:cfg.eval.curve_documents])
    return [runner.HeldoutCurve(cfg.eval.every_n_steps, tokens=tokens, offsets=offsets, docs=sample,
                                clusters=labels[sample], num_clusters=int(sizes.size),
                                labels={k: [v[i] for i in sample] for k, v in corpus.labels.items()},
                                score_args=dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                                                max_tokens=cfg.eval.max_tokens, batch_size=cfg.eval.batch_size),
                                min_cluster_docs=cfg.eval.min_cluster_docs)]


def _train_evaluate_log(cfg, run_dir, logger, stream, model, corpus, labels, sizes, tokens, offsets, tok, train_docs,
                        heldout_docs, stage_results, t_start) -> dict[str, float]:
    corpus_stage, embed_stage, cluster_stage, tokenize_stage = stage_results
    sampler = stream.sampler
    t_train = time.perf_counter()
    trainer, module = runner.fit(cfg, run_dir=run_dir, logger=logger, stream=stream, model=model,
                                 datamodule_args=dict(train_docs=train_docs, tokens=tokens, offsets=offsets,
                                                      eos_id=tok.eos_token_id),
                                 callbacks=_curve_callback(cfg, tokens, offsets, tok, heldout_docs, labels, sizes,
                                                           corpus),
                                 ckpt_path=cfg.train.resume_from)
    train_seconds = time.perf_counter() - t_train
    if not trainer.is_global_zero:
        return {}

    # 3. held-out evaluation
    t_eval = time.perf_counter()
    nll, ntok = document_nll(module.model, tokens, offsets, heldout_docs, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                             max_tokens=cfg.eval.max_tokens, batch_size=cfg.eval.batch_size, device=module.device)
    heldout_labels = {k: [v[i] for i in heldout_docs] for k, v in corpus.labels.items()}
    report = summarize(nll, ntok, labels[heldout_docs], int(sizes.size), heldout_labels,
                       min_cluster_docs=cfg.eval.min_cluster_docs, sizes=sizes)
    metrics = report.metrics
    if cfg.eval.lm_eval is not None:
        from ccexp.evaluation.lm_eval_bridge import evaluate as lm_evaluate

        lm_metrics = lm_evaluate(cfg, module.model, tok, [corpus.texts[i] for i in heldout_docs], heldout_labels, run_dir)
        metrics.update({f"lm_eval/{k}": v for k, v in lm_metrics.items()})
        log.info("lm-eval: %s", ", ".join(f"{k}={v:.3f}" for k, v in lm_metrics.items()
                                          if k.endswith(("/acc", "/word_perplexity"))))
    eval_seconds = time.perf_counter() - t_eval
    log.info("eval: held-out ppl %.2f, macro %.2f, worst cluster %.2f (cluster %d) over %d docs / %d tokens",
             metrics["ppl"], metrics["ppl_macro"], metrics["ppl_worst"], int(metrics["ppl_worst_cluster"]),
             int(metrics["heldout_documents"]), int(metrics["heldout_tokens"]))

    # 4. tracking
    tables = run_dir / "tables"
    tables.mkdir(exist_ok=True)
    exposure = sampler.exposure()
    with open(tables / "clusters.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cluster", "train_size", "exposure", "train_tokens", "train_loss_mean",
                    "heldout_docs", "heldout_tokens", "heldout_ppl"])
        loss_sum, loss_tok = module.cluster_loss_sum.cpu().numpy(), module.cluster_tokens.cpu().numpy()
        for c in range(int(sizes.size)):
            w.writerow([c, int(sizes[c]), int(exposure[c]), int(loss_tok[c]),
                        f"{loss_sum[c] / loss_tok[c]:.5f}" if loss_tok[c] else "",
                        int(report.per_cluster["documents"][c]), int(report.per_cluster["tokens"][c]),
                        f"{report.per_cluster['ppl'][c]:.4f}" if report.per_cluster["tokens"][c] else ""])
    OmegaConf.save(cfg, run_dir / "resolved_config.yaml", resolve=True)
    balance_files = []
    if cfg.eval.balance_report:
        from ccexp.evaluation.balance import write_balance_report
        from ccexp.training.runner import SamplerTelemetry

        tel = next(c for c in trainer.callbacks if isinstance(c, SamplerTelemetry))
        balance_files = write_balance_report(
            run_dir / "balance", name=run_name(cfg), sizes=sizes, exposure=exposure,
            history_steps=np.array(tel.history_steps), history=np.array(tel.history), repetition_hist=
            sampler.repetition_histogram(), heldout_ppl=report.per_cluster["ppl"],
            heldout_docs=report.per_cluster["documents"], metrics=metrics)
    total_seconds = time.perf_counter() - t_start
    timing = {f"time/{s.stage}_seconds": s.seconds for s in (corpus_stage, embed_stage, cluster_stage, tokenize_stage)}
    timing.update({f"cache/{s.stage}_reused": float(s.reused)
                   for s in (corpus_stage, embed_stage, cluster_stage, tokenize_stage)})
    timing.update({"time/train_seconds": train_seconds, "time/eval_seconds": eval_seconds,
                   "time/total_seconds": total_seconds, "train/tokens_per_s": module.tokens_seen / train_seconds,
                   "train/tokens": float(module.tokens_seen), "data/truncated_tokens": float(stream.truncated_tokens),
                   "data/documents_started": float(stream.documents_started)})
    if logger is not None:
        client, run_id = logger.experiment, logger.run_id
        keep = {(k if k.startswith("lm_eval/") else f"eval/{k}"): v for k, v in metrics.items()
                if not k.startswith("ppl_cluster/") or sizes.size <= cfg.eval.max_cluster_metrics}
        logger.log_metrics({**metric_keys(keep), **timing}, step=cfg.train.steps)
        client.log_artifact(run_id, str(run_dir / "resolved_config.yaml"))
        client.log_artifact(run_id, str(tables / "clusters.csv"), "tables")
        for path in balance_files:
            client.log_artifact(run_id, str(path), "balance")
        for key, value in cluster_stage.figures.get("report", {}).items():
            client.log_metric(run_id, f"cluster/{key}", value)
        for path in sorted((cluster_stage.path / "report").glob("*")):
            client.log_artifact(run_id, str(path), "clusters")
        client.set_tag(run_id, "fingerprints", ",".join(f"{s.stage}={s.fingerprint}" for s in
                                                         (corpus_stage, embed_stage, cluster_stage, tokenize_stage)))
        client.set_terminated(run_id, "FINISHED")
    log.info("done: %s in %.0f s (train %.0f s, %.0f tokens/s); outputs in %s", run_name(cfg), total_seconds,
             train_seconds, module.tokens_seen / train_seconds, run_dir)
    return metrics
