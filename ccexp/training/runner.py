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
from ccexp.errors import CcexpError
from ccexp.sampling import Sampler
from ccexp.training.data import SamplerDataModule
from ccexp.training.module import CausalLMModule

log = logging.getLogger("ccexp")


class SamplerTelemetry(Callback):
    """Log the policy's telemetry (``sampler/*``) every ``every`` steps, on rank 0."""

    def __init__(self, sampler: Sampler, every: int):
        self.sampler, self.every = sampler, max(1, int(every))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and trainer.logger is not None and (step % self.every == 0 or step == trainer.max_steps):
            trainer.logger.log_metrics({f"sampler/{k}": v for k, v in self.sampler.telemetry().items()}, step=step)


def build_trainer(cfg: DictConfig, run_dir: Path, logger, callbacks: list[Callback]) -> L.Trainer:
    t = cfg.trainer
    if t.accelerator == "cpu" and t.threads:
        torch.set_num_threads(int(t.threads))
    if t.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise CcexpError(f"trainer={t.name} needs a CUDA GPU and none is visible; use trainer=cpu")
    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0)
    return L.Trainer(accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
                     precision=t.precision, max_steps=cfg.train.steps, logger=logger if logger else False,
                     callbacks=[ckpt, *callbacks], use_distributed_sampler=False,
                     log_every_n_steps=cfg.train.log_every_n_steps, gradient_clip_val=t.gradient_clip_val,
                     accumulate_grad_batches=t.accumulate_grad_batches, enable_progress_bar=t.enable_progress_bar,
                     num_sanity_val_steps=0, default_root_dir=str(run_dir), enable_model_summary=False)


def make_sampler(cfg: DictConfig, train_labels: np.ndarray, sizes: np.ndarray) -> Sampler:
    return build(cfg.sampler, "sampler", labels=train_labels, sizes=sizes, global_batch_size=cfg.train.global_batch_size,
                 seed=cfg.seed, total_steps=cfg.train.steps)


def make_model(cfg: DictConfig, tok) -> torch.nn.Module:
    need = max(cfg.train.seq_len, cfg.eval.max_tokens + 1)
    if cfg.model.name == "tiny_gpt" and cfg.model.n_positions < need:
        raise CcexpError(f"model.n_positions={cfg.model.n_positions} is shorter than train.seq_len / eval.max_tokens+1 "
                         f"({need}); raise model.n_positions")
    return build(cfg.model, "model", vocab_size=len(tok), eos_id=tok.eos_token_id)


def fit(cfg: DictConfig, *, run_dir: Path, logger, sampler: Sampler, model: torch.nn.Module, datamodule_args: dict[str, Any],
        ckpt_path: str | None = None) -> tuple[L.Trainer, CausalLMModule]:
    """Fit ``model`` for ``train.steps`` optimizer steps in the order ``sampler`` chooses."""
    dm = SamplerDataModule(sampler, total_steps=cfg.train.steps, seq_len=cfg.train.seq_len,
                           max_doc_tokens=cfg.train.max_doc_tokens, **datamodule_args)
    module = CausalLMModule(model, sampler.num_clusters, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                            warmup_steps=cfg.train.warmup_steps, total_steps=cfg.train.steps)
    trainer = build_trainer(cfg, run_dir, logger, [SamplerTelemetry(sampler, cfg.train.log_every_n_steps)])
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, module
