"""One ccexp run, top to bottom, like a recipe: pre-flight -> cached stages (typed artifacts) ->
sampler, token stream, model -> fit -> evaluate -> one MLflow record.

The preprocessing stages are cached by content (:mod:`ccexp.stages`), so a sweep over samplers or
models embeds and clusters once.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from omegaconf import DictConfig

from ccexp import stages
from ccexp.artifacts import StageStore
from ccexp.evaluation.balance import write_run_files
from ccexp.evaluation.heldout import evaluate
from ccexp.preflight import check_cluster_counts, preflight
from ccexp.runtime import quiet_libraries
from ccexp.tracking.mlflow_run import RunRecord, run_name
from ccexp.tracking.resume import find_resume
from ccexp.training import runner

log = logging.getLogger("ccexp")


def run(cfg: DictConfig, run_dir: Path, multirun: bool = False) -> dict[str, float]:
    """Run the experiment described by ``cfg``; return the evaluation metrics (rank 0; {} elsewhere)."""
    t_start = time.perf_counter()
    quiet_libraries()
    preflight(cfg, multirun)  # every check, before any work
    import lightning as L

    L.seed_everything(cfg.train.init_seed, workers=True, verbose=False)  # the data order has its own sampler.seed
    outputs = Path(cfg.paths.outputs).resolve()

    # 1. preprocessing: cached stages that return typed artifacts
    stage = stages.Stages(cfg, StageStore(Path(cfg.paths.cache).resolve()))
    corpus = stage.corpus()
    check_cluster_counts(cfg, int((~corpus.heldout).sum()))  # before the embedding is paid for
    pretrained = stage.model()  # the model's local folder (a GGUF file converted once), None for tiny_gpt
    tokenized = stage.tokenize(corpus, pretrained)
    runner.settle_budget(cfg, tokenized, ~corpus.heldout)  # train.passes; a budget the data cannot supply: now
    embeddings = stage.embed(corpus, pretrained)
    clustering = stage.cluster(corpus, embeddings)
    kept = stage.dedup(corpus, embeddings, clustering)  # curate.dedup: near-duplicates removed (None: off)
    split = stages.train_split(corpus, clustering, cfg.sampler.level, stages.select(cfg, corpus, clustering, kept))

    # 2. the components
    sampler = runner.build_sampler(cfg, split, tokenized, stage.reference(split, tokenized, pretrained))  # DoReMi
    stream = runner.build_token_stream(cfg, sampler, split, tokenized)
    model = runner.build_model(cfg, tokenized, pretrained)

    # 3. train, evaluate, record
    tags = {"sampler": cfg.sampler.name, "model": cfg.model.name, "data": cfg.data.name, "run_dir": str(run_dir),
            "recipe": cfg.recipe_name or "none"}
    resume = find_resume(cfg.train.resume_from, run_name(cfg), run_dir, outputs)  # a checkpoint, and its MLflow run
    with RunRecord(cfg, outputs, run_dir, tags, continue_run=resume.run_id) as record:
        signature = runner.run_signature(cfg, stage.fingerprints(), split.num_clusters)
        fit = runner.fit(cfg, run_dir, record.logger, stream, model, tokenized, split, corpus.labels,
                         signature=signature, resume_from=resume.checkpoint)
        if not fit.is_global_zero:
            return {}
        result = evaluate(cfg, fit.model, tokenized, split, corpus, run_dir, average=fit.average)
        files = write_run_files(cfg, run_dir, record.name, split.sizes, fit, result, corpus.labels, split.train_docs)
        step = cfg.train.steps
        record.log_stages(stage.results, stage.cluster_report(), step, stage.curation_report())
        record.log_metrics({**result.for_mlflow(cfg.eval.max_cluster_metrics, split.num_clusters), **fit.metrics(),
                            "time/eval_seconds": result.seconds,
                            "time/total_seconds": time.perf_counter() - t_start}, step)
        for path, folder in files:
            record.log_artifacts([path], folder)
        for part, message in result.errors.items():
            record.set_tag(f"eval_error/{part}", message)
        record.set_tag("stream_digest", fit.stream.digest)
        record.finish()
    log.info("done: %s in %.0f s (train %.0f s, %.0f tokens/s); outputs in %s", record.name,
             time.perf_counter() - t_start, fit.seconds, fit.module.tokens_seen / fit.seconds, run_dir)
    return result.metrics
