"""One ccexp run, top to bottom, like a recipe: pre-flight -> cached stages (typed artifacts) ->
sampler, token stream, model (each from its own part of the config) -> fit -> evaluate -> MLflow. The
stages are cached by content ([`ccexp.stages`][ccexp.stages]): a sweep over samplers or models embeds and clusters once."""
from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from ccexp import stages
from ccexp.artifacts import StageStore
from ccexp.data.sources import source_mix
from ccexp.evaluation.balance import write_run_files
from ccexp.evaluation.heldout import evaluate, heldout_share
from ccexp.names import run_identity
from ccexp.preflight import check_cluster_counts, preflight
from ccexp.runtime import Phases, quiet_libraries
from ccexp.tracking.mlflow_run import RunRecord
from ccexp.launch.resume import find_resume, finished_before
from ccexp.training import runner
from ccexp.training.reference import prior_options

def run(cfg: DictConfig, run_dir: Path, multirun: bool = False) -> dict[str, float]:
    """Run the experiment described by ``cfg``; return the evaluation metrics (rank 0; {} elsewhere)."""
    phases = Phases(since=time.perf_counter() if multirun else None)  # a sweep's jobs share one process
    quiet_libraries(sweep=multirun)
    preflight(cfg, multirun)  # every check, before any work
    outputs = Path(cfg.paths.outputs).resolve()
    phases.mark("start")
    runner.seed_model(cfg.train.init_seed)  # the data order has its own sampler.seed
    # 1. preprocessing: cached stages that return typed artifacts
    stage = stages.Stages(StageStore(Path(cfg.paths.cache).resolve()), data=cfg.data, embedder=cfg.embedder,
                          clusterer=cfg.clusterer, model=cfg.model, curate=cfg.curate)
    corpus = stage.corpus()  # then a checkpoint and MLflow run to continue, or: finished on this corpus already
    resume = find_resume(cfg.train.resume_from, run_identity(cfg), run_dir, outputs, multirun, stage.fingerprints())
    if resume.finished is not None:
        return finished_before(resume, cfg)
    check_cluster_counts(cfg.clusterer, int((~corpus.heldout).sum()))  # before the embedding is paid for
    pretrained = stage.model()  # the model's local folder (a GGUF file converted once), None for tiny_gpt
    tokenized = stage.tokenize(corpus, pretrained)
    mix = source_mix(cfg.data, corpus.labels)  # data.sources' target token shares (None without sources)
    runner.settle_budget(cfg.train, cfg.sampler, tokenized, ~corpus.heldout, mix)  # train.passes; refuse what can't be
    phases.mark("corpus+tokenize")
    embeddings = stage.embed(corpus, pretrained)
    phases.mark("embed")
    clustering = stage.cluster(corpus, embeddings)
    kept = stage.dedup(corpus, embeddings, clustering)  # curate.dedup: near-duplicates removed (None: off)
    split = stages.train_split(corpus, clustering, cfg.sampler.level,
                               stages.select(cfg.selection, corpus, clustering, kept))  # selection.target
    # 2. the components
    prior = prior_options(cfg, stage, split, tokenized, pretrained)  # DoReMi's reference or proxy run ({}: none)
    sampler = runner.build_sampler(cfg.sampler, cfg.train, split, tokenized, sources=mix, **prior)  # mix: token shares
    stream = runner.build_token_stream(cfg.train, sampler, split, tokenized)
    model = runner.build_model(cfg.model, cfg.trainer, tokenized, pretrained, init_seed=cfg.train.init_seed)
    phases.mark("cluster+sampler")
    # 3. train, evaluate, record
    with RunRecord(cfg, outputs, run_dir, resume=resume) as record:
        signature = runner.run_signature(cfg, stage.fingerprints(), split.num_clusters)
        fit = runner.fit(cfg, run_dir, record.loggers, stream, model, tokenized, split, corpus.labels,
                         signature=signature, resume_from=resume.checkpoint)
        phases.mark("train")  # the fit, with the mlflow run's start and the held-out curve's points
        if not fit.is_global_zero:  # under FSDP this rank scores its share of the held-out documents, then stops
            return heldout_share(cfg.eval, fit, tokenized, split)
        result = evaluate(cfg.eval, fit.model, tokenized, split, corpus, run_dir, average=fit.average, ranks=fit.ranks,
                          lm_model=lambda: runner.whole_model(fit, cfg.trainer, run_dir, tokenized), mark=phases.mark)
        if cfg.train.save_model:  # <run>/model: a Hugging Face folder (under FSDP streamed from the checkpoint)
            record.set_tag("model_folder", str(runner.whole_model_folder(fit, run_dir, tokenized.tokenizer)))
        files = write_run_files(cfg, run_dir, record.name, split.sizes, fit, result, corpus.labels, split.train_docs)
        record.log_stages(stage.results, stage.cluster_report(), fit.steps, stage.curation_report())  # at the last step
        record.log_metrics({**result.for_mlflow(cfg.eval.max_cluster_metrics, split.num_clusters), **fit.metrics(),
                            "time/eval_seconds": result.seconds, **phases.metrics()}, fit.steps)
        for path, folder in [*files, (phases.write(run_dir / "timing.json", stage.fingerprints()), None)]:
            record.log_artifacts([path], folder)
        fit.raise_if_stopped_early(cfg.train.steps)  # incomplete: KILLED, not FINISHED; a resume continues it
        record.finish({**{f"eval_error/{p}": m for p, m in result.errors.items()}, "stream_digest": fit.stream.digest},
                      step=fit.steps, metrics=result.metrics, fingerprints=stage.fingerprints())
    phases.done(record.name, fit.seconds, fit.tokens_here, run_dir)  # the time: and done: lines
    return result.metrics

