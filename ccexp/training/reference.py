"""DoReMi's reference run (Xie et al. 2023, Sec. 2): a training step the recipe calls before it builds a
DoReMi sampler with ``sampler.reference_losses=auto``. Its output is kept in the stage cache like a
preprocessing stage (``<cache>/reference/<fingerprint>``), so a sweep over DoReMi's settings trains it once."""
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
        stages: the run's :class:`ccexp.stages.Stages`, whose cache keeps the losses (``cached``) and
            whose upstream fingerprints are in their key.

    Raises:
        CcexpError: from training (e.g. a non-finite loss).
    """
    if not component("sampler", cfg.sampler).reference_run(cfg.sampler):
        return None
    steps = int(cfg.sampler.reference_steps)
    # the documents it trains on and their clusters (after dedup and selection), not only the stages' keys
    split_digest = hashlib.sha256(np.ascontiguousarray(split.train_docs, dtype=np.int64).tobytes()
                                  + np.ascontiguousarray(split.labels[split.train_docs], dtype=np.int64).tobytes())
    upstream = {name: r.fingerprint for name, r in stages.results.items()
                if name in ("corpus", "cluster", "tokenize", "model")}
    fp = keys.stage_fingerprint("reference", *keys.reference_key(cfg, upstream, stages.model_digest(pretrained),
                                                                  split_digest.hexdigest()))
    result = stages.cached("reference", fp, lambda tmp: train_reference(cfg, steps, split, tokenized, pretrained, tmp),
                           lambda f: f"a {f['steps']}-step sampler=random model scored on {f['documents']:,} "
                           f"training docs: loss {f['loss_min']:.2f}..{f['loss_max']:.2f} nats/token over "
                           f"{f['clusters']} clusters")
    return np.load(result.path / "reference_losses.npy")


def train_reference(cfg: DictConfig, steps: int, split: TrainSplit, tokenized: TokenizedCorpus,
                    pretrained: str | None, tmp: Path) -> dict:
    """Train and score :func:`reference_losses`'s model into ``tmp``; its figures."""
    import random

    import torch

    from ccexp.config import RandomConfig
    from ccexp.evaluation.perplexity import document_nll
    from ccexp.training import runner

    ref = cfg.copy()
    with open_dict(ref):
        ref.sampler = OmegaConf.structured(RandomConfig(name="random", level=cfg.sampler.level,
                                                        seed=int(cfg.sampler.seed)))
        ref.train.steps, ref.train.resume_from, ref.train.checkpoint_every_n_steps = steps, None, None
        ref.train.record_batches, ref.eval.every_n_steps = False, None
        ref.trainer.devices, ref.trainer.num_nodes, ref.trainer.strategy = 1, 1, "auto"
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        log.info("reference: training the DoReMi reference model, %d steps with sampler=random", steps)
        sampler = runner.build_sampler(ref.sampler, ref.train, split, tokenized)
        stream = runner.build_token_stream(ref.train, sampler, split, tokenized)
        model = runner.build_model(ref.model, ref.trainer, tokenized, pretrained, init_seed=ref.train.init_seed)
        try:
            fit = runner.fit(ref, tmp / "run", None, stream, model, tokenized, split, {}, signature={})
        except Interrupted as e:  # its checkpoint lives in the discarded stage folder: nothing to resume from
            raise Interrupted(e.signum, f"stopped by {e.name} while training DoReMi's reference model (the reference "
                              "stage is not kept; the next run trains it again)") from None
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
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
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
