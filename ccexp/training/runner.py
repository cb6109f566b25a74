"""Train with Lightning and evaluate on the held-out split; log everything to MLflow."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from omegaconf import DictConfig

from ccexp.build import build
from ccexp.sampling import Sampler
from ccexp.training.data import SamplerDataModule
from ccexp.training.module import CausalLMModule

log = logging.getLogger("ccexp")


class SamplerTelemetry(Callback):
    """Log the policy's telemetry (``sampler/*``: cumulative, and ``window_*`` over the last
    ``every`` steps) every ``every`` steps, on rank 0; with at most ``max_clusters`` clusters also each
    cluster's exposure (documents drawn so far) and, for weighted policies, its weight."""

    def __init__(self, sampler: Sampler, every: int, max_clusters: int = 64):
        self.sampler, self.every, self.max_clusters = sampler, max(1, int(every)), int(max_clusters)
        self.last_exposure = sampler.exposure()
        self.history_steps: list[int] = []  # cumulative exposure at every logged step, for the balance report
        self.history: list[np.ndarray] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not (trainer.is_global_zero and (step % self.every == 0 or step == trainer.max_steps)):
            return
        self.history_steps.append(step)
        self.history.append(self.sampler.exposure())
        if trainer.logger is None:
            return
        metrics = {f"sampler/{k}": v for k, v in self.sampler.telemetry(since=self.last_exposure).items()}
        self.last_exposure = self.sampler.exposure()
        if self.sampler.num_clusters <= self.max_clusters:
            metrics.update({f"sampler/exposure/{c:04d}": float(e) for c, e in enumerate(self.sampler.exposure())})
            weights = self.sampler.weights()
            if weights is not None:
                metrics.update({f"sampler/weight/{c:04d}": float(w) for c, w in enumerate(weights)})
        trainer.logger.log_metrics(metrics, step=step)


class BatchRecorder(Callback):
    """Save the documents each rank trained on, per step, to ``<dir>/rank<r>.npz``: ``steps`` int64[S],
    ``docs`` int64[S, B/W] (this rank's slice) and ``global_docs`` int64[S, B] (the global batch this
    rank's sampler drew), for checking the stream across world sizes and resumes."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.steps, self.docs, self.global_docs = Path(out_dir), [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(batch["step"])
        self.steps.append(step)
        self.docs.append(np.asarray(batch["docs"]))
        self.global_docs.append(np.asarray(trainer.datamodule.drawn[step]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        np.savez(self.out_dir / f"rank{trainer.global_rank}.npz", steps=np.array(self.steps, dtype=np.int64),
                 docs=np.stack(self.docs), global_docs=np.stack(self.global_docs))


def build_trainer(cfg: DictConfig, run_dir: Path, logger, callbacks: list[Callback]) -> L.Trainer:
    t = cfg.trainer
    if t.accelerator == "cpu" and t.threads:
        torch.set_num_threads(int(t.threads))
    every = cfg.train.checkpoint_every_n_steps
    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step-{step}", auto_insert_metric_name=False,
                           save_last=True, save_top_k=-1 if every else 0, every_n_train_steps=every or None)
    return L.Trainer(accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
                     precision=t.precision, max_steps=cfg.train.steps, max_epochs=1, logger=logger if logger else False,
                     callbacks=[ckpt, *callbacks], use_distributed_sampler=False,
                     log_every_n_steps=cfg.train.log_every_n_steps, gradient_clip_val=t.gradient_clip_val,
                     accumulate_grad_batches=t.accumulate_grad_batches, enable_progress_bar=t.enable_progress_bar,
                     num_sanity_val_steps=0, default_root_dir=str(run_dir), enable_model_summary=False)


_BUDGET = object()


def make_sampler(cfg: DictConfig, train_labels: np.ndarray, sizes: np.ndarray,
                 similarity: np.ndarray | None = None, total_steps=_BUDGET) -> Sampler:
    """Build the configured policy over the training documents (``similarity``: float[N_train]
    cosine similarity to the centroid, given to policies that take it)."""
    import inspect

    from hydra.utils import get_method

    extra = {}
    if "similarity" in inspect.signature(get_method(cfg.sampler._target_)).parameters:
        extra["similarity"] = similarity
    return build(cfg.sampler, "sampler", labels=train_labels, sizes=sizes, global_batch_size=cfg.train.global_batch_size,
                 seed=cfg.seed, total_steps=cfg.train.steps if total_steps is _BUDGET else total_steps, **extra)


def make_model(cfg: DictConfig, tok) -> torch.nn.Module:
    return build(cfg.model, "model", vocab_size=len(tok), eos_id=tok.eos_token_id)


def fit(cfg: DictConfig, *, run_dir: Path, logger, sampler: Sampler, model: torch.nn.Module, datamodule_args: dict[str, Any],
        ckpt_path: str | None = None) -> tuple[L.Trainer, CausalLMModule]:
    """Fit ``model`` for ``train.steps`` optimizer steps in the order ``sampler`` chooses."""
    dm = SamplerDataModule(sampler, total_steps=cfg.train.steps, seq_len=cfg.train.seq_len,
                           max_doc_tokens=cfg.train.max_doc_tokens, **datamodule_args)
    module = CausalLMModule(model, sampler.num_clusters, sampler=sampler, lr=cfg.train.lr,
                            weight_decay=cfg.train.weight_decay, warmup_steps=cfg.train.warmup_steps,
                            total_steps=cfg.train.steps)
    callbacks: list[Callback] = [SamplerTelemetry(sampler, cfg.train.log_every_n_steps)]
    if cfg.train.record_batches:
        callbacks.append(BatchRecorder(run_dir / "batches"))
    trainer = build_trainer(cfg, run_dir, logger, callbacks)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    if "spawn" in str(cfg.trainer.strategy):
        # the ranks ran in child processes: take the sampler state of the final checkpoint
        last = run_dir / "checkpoints" / "last.ckpt"
        state = torch.load(last, map_location="cpu", weights_only=False)
        dm.load_state_dict(state[type(dm).__qualname__])
        module.load_state_dict(state["state_dict"], strict=False)
    return trainer, module
