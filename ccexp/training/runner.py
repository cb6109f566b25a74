"""The training components of a run, each from a builder named after what it builds, and the fit.

[`build_sampler`][ccexp.training.runner.build_sampler], [`build_token_stream`][ccexp.training.runner.build_token_stream], [`build_model`][ccexp.training.runner.build_model], [`build_trainer`][ccexp.training.runner.build_trainer] turn the
config and the run's typed artifacts into objects; [`fit`][ccexp.training.runner.fit] trains for ``train.steps`` optimizer
steps of ``train.tokens_per_step`` tokens and returns a [`FitResult`][ccexp.training.runner.FitResult].
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from omegaconf import DictConfig

from ccexp.build import build
from ccexp.config import component
from ccexp.data.packing import TokenStream, stream_lengths
from ccexp.data.split import TrainSplit
from ccexp.data.tokenize import TokenizedCorpus
from ccexp.names import safe_names
from ccexp.sampling import Sampler
from ccexp.training.callbacks import (BatchRecorder, HeldoutCurve, ProgressLog, SamplerTelemetry, StopAtStepEnd,
                                      StoppedByCallback, StopOnSignal, WeightAverage)
from ccexp.training.data import SamplerDataModule
from ccexp.training.extras import build_callbacks
from ccexp.training.module import CausalLMModule

log = logging.getLogger("ccexp")


def build_sampler(sampler: DictConfig, train: DictConfig, split: TrainSplit, tokenized: TokenizedCorpus, *,
                  sources: tuple | None = None, **options) -> Sampler:
    """The ``sampler`` option over the training documents with ``train``'s token budget ([`sampler_over`][ccexp.training.runner.sampler_over]);
    ``sources`` ([`ccexp.data.sources.source_mix`][ccexp.data.sources.source_mix]: each corpus document's source id, the target token
    shares, the names): the option runs inside each source and the sources are mixed at their shares
    ([`SourceMixture`][ccexp.sampling.sources.SourceMixture]); ``options`` (what a prior run computed,
    [`ccexp.training.reference.prior_options`][ccexp.training.reference.prior_options]: DoReMi's reference losses, a proxy run's weights) replace
    the config's values of the same names."""
    if sources is not None:
        sources = (sources[0][split.train_docs], *sources[1:])
    built = sampler_over(sampler, train, split.labels[split.train_docs], split.sizes,
                         tokenized.lengths(split.train_docs), split.similarity[split.train_docs],
                         cluster_names=split.names, sources=sources, **options)
    for level, line in built.notes():
        log.log(level, "%s", line)
    return built


def sampler_over(sampler: DictConfig, train: DictConfig, labels: np.ndarray, sizes: np.ndarray, lengths: np.ndarray,
                 similarity: np.ndarray | None = None, *, cluster_names: list[str] | None = None,
                 sources: tuple | None = None, **options) -> Sampler:
    """The ``sampler`` option over documents with cluster ``labels`` (int[N]) of ``sizes`` (int64[K]) and
    ``lengths`` tokens (int64[N]), with blocks of about one step's documents and ``train``'s token budget
    (so a clipping policy can refuse a budget it cannot supply); ``similarity`` (float[N], cosine to
    the centroid) and ``cluster_names`` (the K clusters' names, None when they have none) for a policy
    that declares it needs them (similarity zeros when not given: no document is nearer than another);
    ``options`` replace the config's values of the same names; ``sources`` (int[N] source ids, float[S] target
    token shares, S names): the option runs inside each source, mixed at those shares."""
    stream_len = stream_lengths(lengths, train.max_doc_tokens)
    block = int(np.clip(np.ceil(train.tokens_per_step / float(np.mean(stream_len))), 1, 2**20))
    inputs = {"similarity": np.zeros(labels.size, np.float32) if similarity is None else similarity,
              "cluster_names": cluster_names}
    extra = {**{name: inputs[name] for name in component("sampler", sampler).needs}, **options}
    shared = dict(block_size=block, document_tokens=stream_len, token_budget=train.steps * train.tokens_per_step + 1)
    if sources is None:
        return build(sampler, "sampler", labels=labels, sizes=sizes, **shared, **extra)
    from ccexp.errors import CcexpError
    from ccexp.sampling.sources import SourceMixture

    if "similarity" in extra:
        raise CcexpError(f"sampler={sampler.name} cannot run inside data.sources (it reads each document's "
                         "similarity to its centroid over the whole corpus); use another sampler or no source weights")

    def inner(labels_s: np.ndarray, sizes_s: np.ndarray, **kw) -> Sampler:
        return build(sampler, "sampler", labels=labels_s, sizes=sizes_s, **{**kw, **extra})

    ids, weights, names = sources
    return SourceMixture(labels, sizes, sources=ids, source_weights=weights, inner=inner, seed=int(sampler.seed),
                         source_names=names, **shared)


PASSES_STEP_LIMIT = 1_000_000  # steps train.passes may derive without train.max_steps


def settle_budget(train: DictConfig, sampler: DictConfig, tokenized: TokenizedCorpus, mask: np.ndarray,
                  sources: tuple | None = None) -> None:
    """Once the corpus is tokenized, before any embedding: ``train.passes`` (the budget in passes over the
    training tokens) becomes ``train.steps``, and a budget the data cannot supply is refused — the
    configured sampler is built over the training documents as one cluster (inside each source, with
    ``sources``), so its own supply check (ClusterClip's and UniMax's ``M · sum of tokens``; a clip does not
    depend on the clusters) fires now, not after the embedding; the exact check with the clusters still comes
    with the run's sampler. With ``sources``, a document so long that a source's share could miss its target by
    more than [`SOURCE_SHARE_MARGIN`][ccexp.training.runner.SOURCE_SHARE_MARGIN] of the run's tokens is warned
    of ([`source_share_drift`][ccexp.training.runner.source_share_drift]).

    Args:
        train: the ``train`` settings (``train.steps`` is set here from ``train.passes``).
        sampler: the ``sampler`` option.
        mask: bool[N], the training documents.
        sources: [`ccexp.data.sources.source_mix`][ccexp.data.sources.source_mix] of the corpus (None: one source).

    Raises:
        CcexpError: when the budget is more than the sampler can supply, or ``train.passes`` derives more than
            [`PASSES_STEP_LIMIT`][ccexp.training.runner.PASSES_STEP_LIMIT] steps without ``train.max_steps``.
    """
    from ccexp.errors import CcexpError

    docs = np.flatnonzero(mask)
    lengths = tokenized.lengths(docs)
    if train.passes is not None:
        total = int(stream_lengths(lengths, train.max_doc_tokens).sum())
        steps = max(1, int(np.ceil(float(train.passes) * total / int(train.tokens_per_step))))
        if train.max_steps is None and steps > PASSES_STEP_LIMIT:  # a typo (1e9 for 1e1), not a first look
            raise CcexpError(f"train.passes={float(train.passes):g} over the {total:,} tokens of {docs.size:,} training "
                             f"documents is {f'{steps:,}' if steps < 10**15 else f'{steps:.3g}'} steps of "
                             f"{int(train.tokens_per_step):,} tokens, more than "
                             f"{PASSES_STEP_LIMIT:,}; give fewer passes, or set train.max_steps to the steps to run")
        capped = train.max_steps is not None and steps > int(train.max_steps)
        steps = int(train.max_steps) if capped else steps
        train.steps = steps
        log.info("train: train.passes=%g over the %s tokens of %s training documents is %s steps of %s tokens%s",
                 float(train.passes), f"{total:,}", f"{docs.size:,}", f"{steps:,}", f"{train.tokens_per_step:,}",
                 f" (capped by train.max_steps: {steps * int(train.tokens_per_step) / total:.2f} passes)"
                 if capped else "")
    options = component("sampler", sampler).stand_in(sampler, 1)  # what a prior run computes
    if sources is not None:
        sources = (sources[0][docs], *sources[1:])
        source_share_drift(train, lengths, sources)
    sampler_over(sampler, train, np.zeros(docs.size, dtype=np.int32), np.array([docs.size], dtype=np.int64), lengths,
                 sources=sources, **options)


SOURCE_SHARE_MARGIN = 0.01  # a source's share of the run's tokens may miss its target by this much without a warning


def source_share_drift(train: DictConfig, lengths: np.ndarray, sources: tuple) -> float:
    """How far a source's share of the run's training tokens can be from its target: the mixture holds every
    source within one document of its share at every token ([`SourceMixture`][ccexp.sampling.sources.SourceMixture]'s
    bound), so the drift is at most the longest document (as the stream places it: ``train.max_doc_tokens``
    caps it) over the run's tokens. Warns, before any embedding, when that exceeds
    [`SOURCE_SHARE_MARGIN`][ccexp.training.runner.SOURCE_SHARE_MARGIN], naming the document's source and what
    brings it down. Returns the bound (a share of the run's tokens, float).

    Args:
        lengths: int64[N] tokens of each training document; sources: (int[N] source ids, float[S] target shares,
            S names) of the training documents.
    """
    ids, weights, names = sources
    stream_len = stream_lengths(lengths, train.max_doc_tokens)
    live = weights[ids] > 0
    if not live.any():
        return 0.0
    longest = int(np.flatnonzero(live)[np.argmax(stream_len[live])])
    budget = int(train.steps) * int(train.tokens_per_step)
    drift = float(stream_len[longest]) / max(1, budget)
    if drift > SOURCE_SHARE_MARGIN:
        log.warning("data.sources: a document of source %r has %s tokens, %.1f%% of the run's %s training tokens; a "
                    "source's share can miss its target by up to that much (a document is drawn whole), more than "
                    "the %.0f%% margin; python -m ccexp.plan shows the planned shares. Cap documents with "
                    "train.max_doc_tokens=%d (the rest of a longer one is not trained on) or raise the budget",
                    names[int(ids[longest])], f"{int(stream_len[longest]):,}", 100 * drift, f"{budget:,}",
                    100 * SOURCE_SHARE_MARGIN, max(1, int(SOURCE_SHARE_MARGIN * budget)))
    return drift


def seed_model(init_seed: int) -> None:
    """Seed the model's initialisation and dropout (Lightning's ``seed_everything``: Python, NumPy and torch,
    and the data loader's workers) with ``train.init_seed``."""
    L.seed_everything(init_seed, workers=True, verbose=False)


def build_token_stream(train: DictConfig, sampler: Sampler, split: TrainSplit, tokenized: TokenizedCorpus) -> TokenStream:
    """The global token stream of ``sampler``'s documents in rows of ``train.seq_len``; logs the run's token budget."""
    t = train
    stream = TokenStream(sampler, tokenized.lengths(split.train_docs), seq_len=t.seq_len,
                         rows_per_step=t.tokens_per_step // t.seq_len, max_doc_tokens=t.max_doc_tokens)
    budget, split_tokens = t.steps * t.tokens_per_step, int(stream.stream_len.sum())
    log.info("train: %d steps x %s tokens = %s tokens (%.2f passes over the %s tokens of %s training documents); "
             "a step is %d rows of %d tokens, %d micro-batch(es) of %d rows per rank", t.steps, f"{t.tokens_per_step:,}",
             f"{budget:,}", budget / max(1, split_tokens), f"{split_tokens:,}", f"{split.train_docs.size:,}",
             stream.rows_per_step, t.seq_len, t.grad_accumulation, t.micro_batch_size)
    return stream


def build_model(model: DictConfig, trainer: DictConfig, tokenized: TokenizedCorpus, pretrained: str | None = None, *,
                init_seed: int) -> torch.nn.Module:
    """The ``model`` option with the tokenizer's vocabulary and separator, initialised from ``init_seed``
    (``pretrained``: the model's local source from [`ccexp.stages.Stages.model`][ccexp.stages.Stages.model], e.g. the folder a
    GGUF file was converted into; under ``trainer``'s FSDP only rank 0 reads it)."""
    from ccexp.config import world_size
    from ccexp.training.distributed import global_rank, uses_fsdp

    torch.manual_seed(int(init_seed))  # the initialisation depends on train.init_seed alone, not on
    # what the stages before it drew (a stage computed in this run, or reused from the cache)
    extra = {"pretrained": pretrained} if pretrained is not None else {}
    if pretrained is not None and uses_fsdp(trainer) and trainer.fsdp.load_weights == "rank0" and global_rank(
            world_size(trainer.devices, 1, trainer.accelerator)) != 0:
        extra["empty"] = True  # the weights come from rank 0 (FSDP sync_module_states)
    return build(model, "model", vocab_size=len(tokenized.tokenizer), eos_id=tokenized.separator_id, **extra)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``torch.save`` checkpoints, written to a temporary sibling and renamed into place, so a
    checkpoint either exists whole or not at all: a full disk or a kill mid-write leaves the previous
    ``last.ckpt`` intact, never a truncated file that looks complete."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        import os
        import uuid

        final = Path(path)
        tmp = final.with_name(f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:6]}.tmp")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def build_trainer(cfg: DictConfig, run_dir: Path, logger, callbacks: list[Callback],
                  model: torch.nn.Module | None = None) -> L.Trainer:
    """``trainer._target_`` (Lightning's Trainer) with the run's steps, accumulation, checkpoints (written
    atomically, [`AtomicCheckpointIO`][ccexp.training.runner.AtomicCheckpointIO]) and callbacks; for ``strategy=fsdp`` the strategy built from
    ``trainer.fsdp`` around ``model`` (its sharded checkpoints are folders it writes itself). In a Slurm
    job Lightning's own requeueing is off (``SLURMEnvironment(auto_requeue=False)``): a stop on a signal
    is ccexp's ([`StopOnSignal`][ccexp.training.callbacks.StopOnSignal]) and a requeue the launcher's (submitit)."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from ccexp.training.distributed import fsdp_strategy, uses_fsdp

    fsdp = uses_fsdp(cfg.trainer) and model is not None
    plugins = [] if fsdp else [AtomicCheckpointIO()]
    if SLURMEnvironment.detect():  # else Lightning saves its own checkpoint and requeues the job on SIGUSR1
        plugins.append(SLURMEnvironment(auto_requeue=False))
    extra = {"strategy": fsdp_strategy(cfg.trainer, model)} if fsdp else {}
    if plugins:
        extra["plugins"] = plugins
    if cfg.trainer.threads:  # on a GPU too: the CPU side of runs packed onto one device (docs/gpu/README.md)
        import os

        torch.set_num_threads(int(cfg.trainer.threads))
        # and in the environment: without OMP_NUM_THREADS Lightning's DDP launcher sets the threads again, to the
        # cores / processes per node (2 nodes x 1 process: every core in each process, whatever trainer.threads says)
        os.environ["OMP_NUM_THREADS"] = str(int(cfg.trainer.threads))
    every = cfg.train.checkpoint_every_n_steps
    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step-{step}", auto_insert_metric_name=False,
                           save_last=True, save_top_k=-1 if every else 0, every_n_train_steps=every or None)
    return build(cfg.trainer, "trainer", max_steps=cfg.train.steps, max_epochs=1, logger=logger or False,
                 callbacks=[ckpt, *callbacks], use_distributed_sampler=False, log_every_n_steps=cfg.train.log_every_n_steps,
                 accumulate_grad_batches=cfg.train.grad_accumulation, num_sanity_val_steps=0,
                 default_root_dir=str(run_dir), enable_model_summary=False, **extra)


def build_curve(cfg: DictConfig, split: TrainSplit, tokenized: TokenizedCorpus, labels: dict[str, list[str]]):
    """The held-out curve on a fixed sample of held-out documents (the same for every run on this
    corpus: drawn with a constant seed, not the run's), or None when ``eval.every_n_steps`` is null."""
    if not cfg.eval.every_n_steps:
        return None
    sample = np.sort(np.random.default_rng(0).permutation(split.heldout_docs)[:cfg.eval.curve_documents])
    tok = tokenized.tokenizer
    return HeldoutCurve(cfg.eval.every_n_steps, tokens=tokenized.tokens, offsets=tokenized.offsets, docs=sample,
                        clusters=split.labels[sample], num_clusters=split.num_clusters,
                        labels={k: [v[i] for i in sample] for k, v in labels.items()},
                        score_args=dict(eos_id=tokenized.separator_id, pad_id=tok.pad_token_id,
                                        prompt_tokens=tokenized.prompt_tokens,
                                        max_tokens=cfg.eval.max_tokens, batch_size=cfg.eval.batch_size),
                        min_cluster_docs=cfg.eval.min_cluster_docs,
                        label_names={k: safe_names(v) for k, v in labels.items()})


@dataclass
class FitResult:
    """What training left: the module (its model and per-cluster sums), whether this process is rank 0,
    the seconds it took, the stream (sampler and token counters) and the telemetry history."""

    module: CausalLMModule
    is_global_zero: bool
    seconds: float
    stream: TokenStream
    telemetry: SamplerTelemetry
    # the trained model: whole, or under FSDP the wrapped root on every rank (its forward gathers the shards), scored
    # with ``ranks``
    model: torch.nn.Module | None = None
    group_field: str | None = None  # the label whose values the module counted tokens for (module.group_*)
    group_names: list[str] | None = None  # its values, by group id
    group_ids: np.ndarray | None = None  # int64[N] each corpus document's group id
    average: torch.nn.Module | None = None  # the averaged weights (eval.average), None when off
    steps: int = 0  # optimizer steps reached (train.steps unless a callback stopped training early)
    stopped_by: str | None = None  # the callback that stopped training before train.steps, if one did
    checkpoint: str | None = None  # where the state of a run stopped early is saved, to resume from
    ranks: tuple[int, int] = (0, 1)  # (rank, world size) that score the model together: the FSDP ranks, else (0, 1)
    exported: Path | None = None  # the Hugging Face folder of the trained model, once written (whole_model_folder)
    # tokens trained before this launch (a resumed run's, which ``seconds`` does not cover); all of them when this
    # launch trained no step (a run continued after its last step: Lightning's fit starts no training then)
    tokens_before: int = 0

    @property
    def tokens_here(self) -> int:
        """Tokens trained in this launch (all ranks): what ``seconds`` paid for."""
        return int(self.module.tokens_seen) - int(self.tokens_before)

    @property
    def sharded(self) -> bool:
        """True when the model is sharded over ranks that must all take part in scoring it."""
        return self.ranks[1] > 1

    def raise_if_stopped_early(self, steps: int) -> None:
        """Raise [`StoppedEarly`][ccexp.errors.StoppedEarly] when a callback stopped training before ``steps``.

        Raises:
            StoppedEarly: naming the step reached and the checkpoint to resume from.
        """
        if self.stopped_by is not None:
            from ccexp.errors import StoppedEarly

            raise StoppedEarly(self.steps, steps, self.checkpoint, self.stopped_by)

    def release_training_state(self) -> None:
        """Free what only training needed (the optimizer's state: AdamW's two moments, 8 bytes a parameter, and
        the last step's gradients, on this rank's device), before a whole copy of the model is loaded for lm-eval."""
        trainer = self.module._trainer
        for optimizer in (trainer.optimizers if trainer is not None else []):
            optimizer.state.clear()
            optimizer.zero_grad(set_to_none=True)  # the last step's gradient shards
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def metrics(self) -> dict[str, float]:
        """``train/*`` and ``data/*`` figures of the run; this launch's throughput (``train/tokens_per_s``,
        ``time/train_seconds``) only when it trained a token (a continued run's MLflow run keeps its earlier launch's:
        an empty fit's fraction of a second over the run's tokens is no speed)."""
        tokens = self.module.tokens_seen
        speed = {"train/tokens_per_s": self.tokens_here / self.seconds, "time/train_seconds": self.seconds} \
            if self.tokens_here > 0 and self.seconds > 0 else {}
        return {"train/tokens": float(tokens), **speed, "data/truncated_tokens": float(self.stream.truncated_tokens),
                "data/documents_started": float(self.stream.documents_started),
                "train/skipped_tokens": float(self.module.skipped_tokens)}


def label_groups(labels: dict[str, list[str]]) -> tuple[str | None, list[str], np.ndarray | None]:
    """The first label field of the corpus, its sorted values and each document's value id
    (int64[N]), for per-label accounting of the tokens trained; ``(None, [], None)`` without labels."""
    from ccexp.clustering.labels import value_ids

    if not labels:
        return None, [], None
    field = next(iter(labels))
    return (field, *value_ids(labels[field]))


def run_signature(cfg: DictConfig, fingerprints: dict[str, str], num_clusters: int) -> dict:
    """The settings that define a run's token stream and model: written into its checkpoints and
    compared on resume ([`check_resume`][ccexp.training.runner.check_resume]). Steps, evaluation, logging and checkpointing may change."""
    import json

    from omegaconf import OmegaConf

    from ccexp.config import world_size

    def settings(node) -> str:
        return json.dumps({k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "name"},
                          sort_keys=True, default=str)

    t = cfg.train
    return {"corpus": fingerprints.get("corpus"), "embedding": fingerprints.get("embed"),
            "clustering": fingerprints.get("cluster"), "clusters": int(num_clusters),
            "tokenizer": fingerprints.get("tokenize"), "sampler": settings(cfg.sampler),
            "selection": settings(cfg.selection), "train.init_seed": int(cfg.train.init_seed),
            "model": settings(cfg.model),
            "train.tokens_per_step": int(t.tokens_per_step), "train.seq_len": int(t.seq_len),
            "train.max_doc_tokens": t.max_doc_tokens, "train.document_mask": bool(t.document_mask),
            "train.micro_batch_size": int(t.micro_batch_size),
            "trainer.devices x trainer.num_nodes": world_size(cfg.trainer.devices, int(cfg.trainer.num_nodes),
                                                              str(cfg.trainer.accelerator))}


def check_resume(path: str, signature: dict, sharded: bool = False) -> int:
    """Refuse, in one line naming what differs, to resume a checkpoint saved under other settings; return
    the optimizer step it was saved after. ``path`` is a ``.ckpt`` file or, with ``sharded`` (the run's trainer is
    FSDP), a sharded checkpoint folder, whose signature and step are in its ``meta.pt``.

    Raises:
        CcexpError: if the checkpoint is missing or unreadable, or its settings differ from ``signature``.
    """
    from ccexp.errors import CcexpError

    source = Path(path)
    if source.is_dir() and (source / "meta.pt").is_file():
        if not sharded:
            raise CcexpError(f"train.resume_from={path} is a sharded (FSDP) checkpoint folder; continue it with the "
                             "FSDP trainer it was written by (trainer.strategy=fsdp), or export it first "
                             "(train.save_model=true writes <run>/model)")
        source = source / "meta.pt"  # a sharded (FSDP) checkpoint folder: Lightning keeps all but the tensors here
    if not source.is_file():
        raise CcexpError(f"train.resume_from={path!r} does not exist; give a checkpoint (.ckpt) of an earlier run "
                         "or train.resume_from=last")
    try:
        checkpoint = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CcexpError(f"train.resume_from={path!r} is not a readable checkpoint ({str(e).splitlines()[0][:120]})"
                         ) from None
    saved, step = checkpoint.get("ccexp"), int(checkpoint.get("global_step", 0))
    if saved is None:
        log.warning("resume: %s carries no ccexp run signature; its settings cannot be checked", path)
        return step
    differ = [f"{key} {saved.get(key)!r} -> {signature.get(key)!r}" for key in sorted(set(saved) | set(signature))
              if saved.get(key) != signature.get(key)]
    if differ:
        raise CcexpError(f"train.resume_from={path} was saved with other settings ({'; '.join(differ)}); resume with "
                         "the same corpus, clustering, sampler, model and token budget, or start a new run")
    return step


def fit(cfg: DictConfig, run_dir: Path, loggers: list | None, stream: TokenStream, model: torch.nn.Module,
        tokenized: TokenizedCorpus, split: TrainSplit, labels: dict[str, list[str]], *, signature: dict,
        resume_from: str | None = None) -> FitResult:
    """Fit ``model`` for ``train.steps`` optimizer steps of ``train.tokens_per_step`` tokens each, in the
    order ``stream``'s sampler chooses (resuming from ``resume_from``, checked against ``signature``).

    Raises:
        CcexpError: for a checkpoint saved under other settings, or a non-finite loss or gradient.
        Interrupted: when SIGTERM or SIGINT stopped training (after saving a checkpoint).
    """
    t0 = time.perf_counter()
    if resume_from:
        step = check_resume(resume_from, signature, sharded=str(cfg.trainer.strategy).startswith("fsdp"))
        # Lightning cannot see that the data module restores the stream exactly, and warns otherwise
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")
        log.info("resume: continuing after step %d from %s on exactly the tokens an uninterrupted run trains on (the "
                 "sampler's and the token stream's state are in the checkpoint)", step, resume_from)
    sampler = stream.sampler
    group_field, group_names, groups = label_groups(labels)
    dm = SamplerDataModule(stream, split.train_docs, tokenized.tokens, tokenized.offsets, total_steps=cfg.train.steps,
                           micro_batch_size=cfg.train.micro_batch_size, grad_accumulation=cfg.train.grad_accumulation,
                           eos_id=tokenized.separator_id, document_mask=cfg.train.document_mask,
                           prompt_tokens=tokenized.prompt_tokens, groups=groups)
    module = CausalLMModule(model, sampler.num_clusters, sampler=sampler, lr=cfg.train.lr,
                            weight_decay=cfg.train.weight_decay, warmup_steps=cfg.train.warmup_steps,
                            total_steps=cfg.train.steps, on_nonfinite=cfg.train.on_nonfinite, signature=signature,
                            num_groups=len(group_names))
    telemetry = SamplerTelemetry(sampler, cfg.train.log_every_n_steps)
    average = WeightAverage(cfg.eval.average, cfg.eval.average_span, cfg.train.steps) \
        if cfg.eval.average != "none" else None
    progress = ProgressLog(cfg.train.log_every_n_steps)  # and the tokens trained before this launch
    callbacks = [telemetry, progress, build_curve(cfg, split, tokenized, labels),
                 StopOnSignal(run_dir / "checkpoints" / "last.ckpt"), average,
                 BatchRecorder(run_dir / "batches") if cfg.train.record_batches else None]
    callbacks += build_callbacks(cfg.get("callbacks"))  # the callbacks group (lr_monitor, debug=overfit, ...)
    # after them: a callback that stops training does so at an optimizer step's end, with a checkpoint
    boundary = StopAtStepEnd(run_dir / "checkpoints" / "last.ckpt", int(cfg.train.steps))
    loggers = list(loggers or [])  # the run record's: MLflow first, then logger.loggers (TensorBoard)
    trainer = build_trainer(cfg, run_dir, loggers, [c for c in callbacks + [boundary] if c is not None], model)
    with contextlib.suppress(StoppedByCallback):  # its checkpoint is saved; the model at that step is evaluated
        trainer.fit(module, datamodule=dm, ckpt_path=resume_from)
    sharded = isinstance(trainer.strategy, FSDPStrategy)  # scored sharded, on every rank: never gathered whole
    # Lightning's teardown left an unsharded model on the CPU (Strategy.teardown): back on the training device
    whole = trainer.strategy.model if sharded else module.model.to(trainer.strategy.root_device)
    spawned, reached = "spawn" in str(cfg.trainer.strategy), int(trainer.global_step)
    if spawned:
        # the ranks ran in child processes: take the sampler and stream state of the final checkpoint
        state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        reached = int(state.get("global_step", reached))
        dm.load_state_dict(state[type(dm).__qualname__])
        module.load_state_dict(state["state_dict"], strict=False)
        if average is not None:
            average.setup(trainer, module, "fit")
            average.load_state_dict(state["callbacks"][average.state_key])
    return FitResult(module, trainer.is_global_zero, time.perf_counter() - t0, stream, telemetry, whole,
                     group_field, group_names, groups, None if average is None else average.model,
                     steps=reached, ranks=(trainer.global_rank, trainer.world_size) if sharded else (0, 1),
                     tokens_before=module.tokens_seen if progress.tokens_at_start is None else progress.tokens_at_start,
                     **_stopped_early(trainer, boundary, reached, int(cfg.train.steps), spawned))


def whole_model_folder(fit: FitResult, run_dir: Path, tokenizer) -> Path:
    """``<run_dir>/model``, the trained model as a Hugging Face folder ([`ccexp.training.export`][ccexp.training.export]),
    written now unless this run already wrote it: from the model itself, or under FSDP streamed from the run's final
    checkpoint (``checkpoints/last.ckpt``, sharded or full). Rank 0 only, after training."""
    from ccexp.training.export import export_checkpoint, export_model

    out = Path(run_dir) / "model"
    if fit.exported == out and out.is_dir():
        return out
    if type(fit.model).__name__ == "FullyShardedDataParallel":
        checkpoint = Path(fit.checkpoint or Path(run_dir) / "checkpoints" / "last.ckpt")
        export_checkpoint(checkpoint, fit.module.model.config, out, tokenizer)
    else:
        export_model(fit.module.model, out, tokenizer)
    fit.exported = out
    return out


def whole_model(fit: FitResult, trainer: DictConfig, run_dir: Path, tokenized: TokenizedCorpus) -> torch.nn.Module:
    """The trained model whole, for lm-eval: the weights the headline held-out metrics are of, i.e. the averaged
    weights (``fit.average``) under ``eval.average=ema|tail``, else the model itself when it was not sharded; under
    FSDP (which ``eval.average`` is refused with) the optimizer's
    state is freed ([`FitResult.release_training_state`][ccexp.training.runner.FitResult.release_training_state]) and
    the exported folder ([`whole_model_folder`][ccexp.training.runner.whole_model_folder]) is loaded on rank 0's device,
    in the training's compute dtype (bfloat16 for ``bf16-*`` precision: half the bytes of float32 weights)."""
    from ccexp.training.export import load_exported

    if type(fit.model).__name__ != "FullyShardedDataParallel":
        return fit.model if fit.average is None else fit.average
    fit.release_training_state()
    folder = whole_model_folder(fit, run_dir, tokenized.tokenizer)
    precision = str(trainer.precision)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None
    device = next(fit.model.parameters()).device
    log.info("lm-eval: the trained model loaded whole from %s on %s%s", folder, device,
             f" in {str(dtype).removeprefix('torch.')}" if dtype is not None else "")
    return load_exported(folder, device, dtype)


def _stopped_early(trainer, boundary: StopAtStepEnd, reached: int, steps: int, spawned: bool) -> dict:
    """``{stopped_by, checkpoint}`` when training ended after ``reached`` < ``steps`` optimizer steps (the
    checkpoint [`StopAtStepEnd`][ccexp.training.callbacks.StopAtStepEnd] saved), ``{}`` for a complete run; ``spawned``:
    the ranks ran in child processes (their checkpoint is the state; this process has none to save)."""
    if reached >= steps:
        return {}
    by = boundary.by or "a callback"
    log.warning("train: %s stopped training after step %d of %d; the run is incomplete", by, reached, steps)
    if boundary.stopped_at is None and not spawned:  # stopped outside a training batch: the state as it is
        trainer.save_checkpoint(boundary.path, weights_only=False)
    return {"stopped_by": by, "checkpoint": str(boundary.path)}
