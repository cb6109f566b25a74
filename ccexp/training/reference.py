"""DoReMi's prior runs (Xie et al. 2023, Sec. 2), training steps the recipe calls before it builds a sampler
that needs one ([`prior_options`][ccexp.training.reference.prior_options]): the *reference* run, whose per-cluster losses a DoReMi sampler with
``sampler.reference_losses=auto`` reads, and the *proxy* run, a DoReMi run whose average weights
``sampler=mixture sampler.weights=doremi`` then trains on (DoReMi's two-step recipe in one command).
Their outputs are kept in the stage cache like a preprocessing stage (``<cache>/reference/<fingerprint>``,
``<cache>/proxy/<fingerprint>``), so a sweep over seeds or samplers trains each once."""
from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from ccexp import stage_keys as keys
from ccexp.config import component
from ccexp.data.split import TrainSplit
from ccexp.data.tokenize import TokenizedCorpus
from ccexp.errors import Interrupted

log = logging.getLogger("ccexp")


def prior_options(cfg: DictConfig, stages, split: TrainSplit, tokenized: TokenizedCorpus,
                  pretrained: str | None = None) -> dict:
    """The sampler options a prior run computes, as its schema declares (``prior_run``): DoReMi's reference
    losses (``{"reference_losses": float64[K]}``), the proxy run's learned weights (``{"weights": float64[K]}``),
    or ``{}`` for a sampler that needs none.

    Raises:
        CcexpError: from training (e.g. a non-finite loss).
    """
    prior = component("sampler", cfg.sampler).prior_run(cfg.sampler)
    if prior == "reference":
        return {"reference_losses": reference_losses(cfg, stages, split, tokenized, pretrained)}
    if prior == "proxy":
        return {"weights": proxy_weights(cfg, stages, split, tokenized, pretrained)}
    return {}


def reference_losses(cfg: DictConfig, stages, split: TrainSplit, tokenized: TokenizedCorpus,
                     pretrained: str | None = None) -> np.ndarray | None:
    """DoReMi's per-cluster reference losses (float64[K], nats/token) when ``sampler.rule=doremi`` and
    ``sampler.reference_losses=auto``; None otherwise (the sampler reads a given list or file itself).

    The reference model is the run's model trained from the same start for ``sampler.reference_steps``
    optimizer steps of the same token budget with ``sampler=random`` (the natural mix: DoReMi's
    reference, Xie et al. 2023, Sec. 2, trained on the default domain weights), on one device; it is
    then scored on up to ``sampler.reference_documents`` training documents of every cluster (a fixed
    sample), its loss per cluster being the token-weighted mean. Cached as ``<cache>/reference/<fp>``,
    so a sweep over DoReMi's settings trains it once. The global random state is restored afterwards,
    so the run's own model starts the same whether the reference was computed or reused.

    Args:
        stages: the run's [`ccexp.stages.Stages`][ccexp.stages.Stages], whose cache keeps the losses (``cached``) and
            whose upstream fingerprints are in their key.

    Raises:
        CcexpError: from training (e.g. a non-finite loss).
    """
    if component("sampler", cfg.sampler).prior_run(cfg.sampler) != "reference":
        return None
    steps = int(cfg.sampler.reference_steps)
    fp = keys.stage_fingerprint("reference", *keys.reference_key(cfg, *_upstream(stages, split, pretrained)))
    result = stages.cached("reference", fp, lambda tmp: train_reference(cfg, steps, split, tokenized, pretrained, tmp),
                           lambda f: f"a {f['steps']}-step sampler=random model scored on {f['documents']:,} "
                           f"training docs: loss {f['loss_min']:.2f}..{f['loss_max']:.2f} nats/token over "
                           f"{f['clusters']} clusters")
    return np.load(result.path / "reference_losses.npy")


def _upstream(stages, split: TrainSplit, pretrained: str | None) -> tuple[dict, str | None, str]:
    """What a prior run's key holds besides its settings: the upstream stages' fingerprints, the model's
    weights, and the documents it trains on with their clusters (after dedup and selection)."""
    split_digest = hashlib.sha256(np.ascontiguousarray(split.train_docs, dtype=np.int64).tobytes()
                                  + np.ascontiguousarray(split.labels[split.train_docs], dtype=np.int64).tobytes())
    upstream = {name: r.fingerprint for name, r in stages.results.items()
                if name in ("corpus", "cluster", "tokenize", "model")}
    return upstream, stages.model_digest(pretrained), split_digest.hexdigest()


def side_config(cfg: DictConfig, sampler, steps: int) -> DictConfig:
    """``cfg`` for a prior run: the ``sampler`` schema instance, ``steps`` optimizer steps, one device, no
    resume, checkpoints, batch records, held-out curve, profiler or the run's own callbacks (a logger-less
    side run: ``callbacks=lr_monitor`` would refuse it, ``debug=overfit`` would train it on one batch)."""
    side = cfg.copy()
    with open_dict(side):
        side.sampler = OmegaConf.structured(sampler)
        side.train.steps, side.train.resume_from, side.train.checkpoint_every_n_steps = steps, None, None
        side.train.record_batches, side.eval.every_n_steps = False, None
        side.trainer.devices, side.trainer.num_nodes, side.trainer.strategy = 1, 1, "auto"
        side.trainer.profiler, side.callbacks = None, {}
    return side


def side_fit(side: DictConfig, split: TrainSplit, tokenized: TokenizedCorpus, pretrained: str | None, run_dir: Path,
             what: str, **options):
    """Train ``side``'s model on ``side``'s sampler (``options``: what that sampler's own prior run computed)
    into ``run_dir``, the global random state restored afterwards (the run's own model starts the same
    whether the prior run was computed or reused); the [`FitResult`][ccexp.training.runner.FitResult]."""
    import random

    import torch

    from ccexp.training import runner

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        sampler = runner.build_sampler(side.sampler, side.train, split, tokenized, **options)
        stream = runner.build_token_stream(side.train, sampler, split, tokenized)
        model = runner.build_model(side.model, side.trainer, tokenized, pretrained, init_seed=side.train.init_seed)
        return runner.fit(side, run_dir, None, stream, model, tokenized, split, {}, signature={})
    except Interrupted as e:  # its checkpoint lives in the discarded stage folder: nothing to resume from
        raise Interrupted(e.signum, f"stopped by {e.name} while training DoReMi's {what} model (the {what} stage is "
                          "not kept; the next run trains it again)") from None
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def train_reference(cfg: DictConfig, steps: int, split: TrainSplit, tokenized: TokenizedCorpus,
                    pretrained: str | None, tmp: Path) -> dict:
    """Train and score [`reference_losses`][ccexp.training.reference.reference_losses]'s model into ``tmp``; its figures."""
    from ccexp.config import RandomConfig
    from ccexp.evaluation.perplexity import document_nll

    ref = side_config(cfg, RandomConfig(name="random", level=cfg.sampler.level, seed=int(cfg.sampler.seed)), steps)
    log.info("reference: training the DoReMi reference model, %d steps with sampler=random", steps)
    fit = side_fit(ref, split, tokenized, pretrained, tmp / "run", "reference")
    rng = np.random.default_rng([int(cfg.sampler.seed), 0x5245])  # "RE": the same sample for every DoReMi setting
    docs = rng.permutation(split.train_docs)
    clusters = split.labels[docs]
    order = np.argsort(clusters, kind="stable")  # each cluster's first documents of the permutation
    rank = np.arange(docs.size) - np.searchsorted(clusters[order], clusters[order])
    sample = np.sort(docs[order][rank < int(cfg.sampler.reference_documents)])
    tok = tokenized.tokenizer
    nll, ntok = document_nll(fit.model, tokenized.tokens, tokenized.offsets, sample, eos_id=tokenized.separator_id,
                             pad_id=tok.pad_token_id, max_tokens=cfg.eval.max_tokens,
                             batch_size=cfg.eval.batch_size, prompt_tokens=tokenized.prompt_tokens,
                             device=next(fit.model.parameters()).device)
    k = split.num_clusters
    loss_sum = np.bincount(split.labels[sample], weights=nll, minlength=k)
    token_sum = np.bincount(split.labels[sample], weights=ntok, minlength=k)
    scored = token_sum > 0
    losses = np.full(k, float(loss_sum.sum() / max(token_sum.sum(), 1)))  # clusters without training docs
    losses[scored] = loss_sum[scored] / token_sum[scored]
    np.save(tmp / "reference_losses.npy", losses)
    shutil.rmtree(tmp / "run", ignore_errors=True)  # its checkpoints: the losses are the stage's output
    return {"steps": steps, "documents": int(sample.size), "tokens": int(token_sum.sum()), "clusters": int(scored.sum()),
            "loss_min": float(losses[scored].min()), "loss_max": float(losses[scored].max()),
            "train_seconds": fit.seconds}


def proxy_weights(cfg: DictConfig, stages, split: TrainSplit, tokenized: TokenizedCorpus,
                  pretrained: str | None = None) -> np.ndarray:
    """DoReMi's step 2 (Xie et al. 2023, Sec. 2 and Alg. 1): a proxy run of ``sampler.proxy_steps`` optimizer steps
    with ``sampler=dynamic rule=doremi`` (its default settings, its own reference run first) on the same
    documents, model and token budget per step; float64[K], its weights averaged over its updates, as token
    shares ([`ccexp.sampling.dynamic.DynamicSampler.average_weights`][ccexp.sampling.dynamic.DynamicSampler.average_weights]; with ``sampler.weight_unit=documents``
    its averaged draw probabilities), which ``sampler=mixture`` then trains on. Cached as ``<cache>/proxy/<fp>``.

    Raises:
        CcexpError: from training (e.g. a non-finite loss).
    """
    from ccexp.config import DynamicConfig

    steps = int(cfg.sampler.proxy_steps)
    proxy = side_config(cfg, DynamicConfig(name="doremi", rule="doremi", level=cfg.sampler.level,
                                           seed=int(cfg.sampler.seed)), steps)
    losses = reference_losses(proxy, stages, split, tokenized, pretrained)
    fp = keys.stage_fingerprint("proxy", *keys.proxy_key(proxy, steps, *_upstream(stages, split, pretrained),
                                                         hashlib.sha256(losses.tobytes()).hexdigest()))

    def produce(tmp: Path) -> dict:
        log.info("proxy: training DoReMi's proxy model, %d steps with sampler=dynamic rule=doremi", steps)
        fit = side_fit(proxy, split, tokenized, pretrained, tmp / "run", "proxy", reference_losses=losses)
        weights = fit.stream.sampler.average_weights()
        np.save(tmp / "weights.npy", weights)  # token shares
        np.save(tmp / "document_weights.npy", fit.stream.sampler.average_draw_weights())  # draw probabilities
        shutil.rmtree(tmp / "run", ignore_errors=True)  # its checkpoints: the weights are the stage's output
        return {"steps": steps, "clusters": int(weights.size), "weight_min": float(weights.min()),
                "weight_max": float(weights.max()), "train_seconds": fit.seconds}

    result = stages.cached("proxy", fp, produce, lambda f: f"a {f['steps']}-step DoReMi proxy learned token shares "
                           f"{f['weight_min']:.4f}..{f['weight_max']:.4f} over {f['clusters']} clusters")
    return np.load(result.path / ("document_weights.npy" if cfg.sampler.weight_unit == "documents" else "weights.npy"))
