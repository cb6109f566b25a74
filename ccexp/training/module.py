"""The LightningModule: causal-LM loss with an exact per-cluster breakdown."""
from __future__ import annotations

import math

import logging

import lightning as L
import torch
import torch.nn.functional as F

log = logging.getLogger("ccexp")


class CausalLMModule(L.LightningModule):
    """Train a causal LM on micro-batches of the global token stream ([`ccexp.data.packing`][ccexp.data.packing]).

    Logs ``train/loss`` (the optimizer step's token-mean loss over all micro-batches and ranks,
    nats) and ``train/tokens`` (targets trained so far, all ranks) each step, and keeps per-cluster
    running sums of loss (nats) and tokens, float64[K] and int64[K], for telemetry and evaluation.

    At the last micro-batch of every optimizer step the step's per-cluster summed token loss and
    token counts (float64[K], int64[K]) are all-reduced over data-parallel ranks and passed to
    ``sampler.observe`` once — the feedback that dynamic policies use — before any callback runs,
    so a checkpoint taken after the step holds it. When the sampler has ``loss_weights()``
    (CluSTER), token t's loss is multiplied by ``w[cluster(t)]``. A batch with a ``loss_mask``
    (instruction data) trains on the masked-in (response) targets only: its loss is their mean, and
    only they count as trained tokens. A batch with ``position_ids``
    (``train.document_mask``) makes Hugging Face models attend only within each document.

    Args:
        model: a ``transformers`` causal LM.
        num_clusters: K.
        sampler: the policy that orders the data (optional in tests).
        lr, weight_decay, betas: AdamW settings.
        warmup_steps, total_steps: linear warm-up then cosine decay to 10 % of ``lr``.
        on_nonfinite: ``stop`` (a non-finite loss raises [`CcexpError`][ccexp.errors.CcexpError] naming the
            step and the last good checkpoint) or ``skip_batch`` (that micro-batch is skipped and its
            tokens counted in ``skipped_tokens``); a non-finite gradient always stops.
        signature: the settings that define the run's stream and model, written into every
            checkpoint (``checkpoint["ccexp"]``) so a resume can be checked against them.

    Raises:
        CcexpError: for an unknown ``on_nonfinite``.
    """

    def __init__(self, model: torch.nn.Module, num_clusters: int, *, sampler=None, lr: float, weight_decay: float,
                 warmup_steps: int, total_steps: int, betas: tuple[float, float] = (0.9, 0.95),
                 on_nonfinite: str = "stop", signature: dict | None = None, num_groups: int = 0):
        super().__init__()
        self.model = model
        self.sampler = sampler
        self.num_clusters = int(num_clusters)
        weights = sampler.loss_weights() if sampler is not None else None
        self.register_buffer("loss_weights", None if weights is None else torch.as_tensor(weights, dtype=torch.float32),
                             persistent=False)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)
        self.register_buffer("cluster_loss_sum", torch.zeros(self.num_clusters, dtype=torch.float64), persistent=True)
        self.register_buffer("cluster_tokens", torch.zeros(self.num_clusters, dtype=torch.int64), persistent=True)
        # the same per value of a label (batches with group_ids): tokens trained and their summed loss
        self.num_groups = int(num_groups)
        self.register_buffer("group_loss_sum", torch.zeros(self.num_groups, dtype=torch.float64), persistent=True)
        self.register_buffer("group_tokens", torch.zeros(self.num_groups, dtype=torch.int64), persistent=True)
        # the open step's summed token loss and token counts over its micro-batches, per "cluster" and "group"
        self._open: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if on_nonfinite not in ("stop", "skip_batch"):
            from ccexp.errors import CcexpError

            raise CcexpError(f"train.on_nonfinite={on_nonfinite!r} is not an option; use stop or skip_batch")
        self.on_nonfinite = on_nonfinite
        self.skipped_tokens = 0
        self.last_loss = float("nan")
        self.signature = dict(signature or {})  # what defines this run's stream and model, saved in checkpoints

    def forward(self, **inputs):
        """The causal LM on ``inputs`` (``input_ids``, ``attention_mask``, ...; its ``transformers`` output): how
        held-out scoring calls a sharded model, through the FSDP root whose forward gathers the root's shards."""
        return self.model(**inputs)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["ccexp"] = self.signature

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """One micro-batch of ``[m, L]`` rows: token-mean cross-entropy over its ``m·L`` targets (every
        micro-batch is full, so Lightning's division by the accumulation count gives the step's
        token mean). The per-cluster sums accumulate over the step's micro-batches; after the last
        one they are all-reduced over ranks, passed to ``sampler.observe`` once, and logged."""
        out = self.model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False)
        loss_tok = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                   reduction="none")
        cid = batch["cluster_ids"].flatten()
        gid = batch["group_ids"].flatten() if "group_ids" in batch and self.num_groups else None
        weight = None if self.loss_weights is None else self.loss_weights[cid]
        mask = batch.get("loss_mask")
        if mask is None:
            loss = loss_tok.mean() if weight is None else (loss_tok * weight).mean()
        else:  # instruction data: the mean over the micro-batch's response tokens only
            mask = mask.flatten().to(loss_tok.dtype)
            loss = (loss_tok * mask * (1.0 if weight is None else weight)).sum() / mask.sum().clamp(min=1.0)
            loss_tok, cid = loss_tok[mask.bool()], cid[mask.bool()]
            gid = None if gid is None else gid[mask.bool()]
        if self._not_finite(loss):
            if self.on_nonfinite == "stop":
                raise self._nonfinite_error("the training loss", batch)
            self.skipped_tokens += int(cid.numel())  # skip_batch: no backward, no per-cluster sums
            log.warning("train: non-finite loss at step %d, micro-batch %d: skipped (train.on_nonfinite=skip_batch)",
                        int(batch["step"]), int(batch["micro"]))
            if bool(batch["last_micro"]):
                self._end_of_step(int(batch["step"]))
            return None
        with torch.no_grad():
            self._add_to_step("cluster", cid, self.num_clusters, loss_tok)
            if gid is not None:
                self._add_to_step("group", gid, self.num_groups, loss_tok)
            if bool(batch["last_micro"]):
                self._end_of_step(int(batch["step"]))
        return loss

    def _add_to_step(self, key: str, ids: torch.Tensor, size: int, loss_tok: torch.Tensor) -> None:
        """Add a micro-batch's token losses to the open step's sums per id (float64[size], int64[size])."""
        sums = self._open.get(key)
        if sums is None or sums[0].device != ids.device:
            sums = self._open[key] = (torch.zeros(size, dtype=torch.float64, device=ids.device),
                                      torch.zeros(size, dtype=torch.int64, device=ids.device))
        sums[0].index_add_(0, ids, loss_tok.double())
        sums[1].index_add_(0, ids, torch.ones_like(ids))

    def _step_sums(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The open step's sums for ``key``, summed over data-parallel ranks."""
        loss, tokens = self._open[key]
        if self.trainer.world_size > 1:
            loss = self.trainer.strategy.reduce(loss, reduce_op="sum")
            tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
        return loss, tokens

    def _not_finite(self, value: torch.Tensor) -> bool:
        """True when ``value`` is NaN or infinite on any rank (agreed, so every rank takes the same path)."""
        bad = (~torch.isfinite(value.detach())).float().reshape(1)
        if self.trainer.world_size > 1:
            bad = self.trainer.strategy.reduce(bad, reduce_op="max")
        return bool(bad.item())

    def _nonfinite_error(self, what: str, batch: dict | None = None):
        from ccexp.errors import CcexpError

        ckpt = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or ""
        where = f"step {int(batch['step'])}, micro-batch {int(batch['micro'])}" if batch else f"step {self.global_step}"
        return CcexpError(f"{what} is not finite (NaN or inf) at {where}; "
                          + (f"the last good checkpoint is {ckpt}; " if ckpt else "no checkpoint was saved before it; ")
                          + "lower train.lr, keep trainer.gradient_clip_val, or set train.on_nonfinite=skip_batch "
                          "to skip such micro-batches")

    def on_before_optimizer_step(self, optimizer) -> None:
        """Stop before a non-finite gradient reaches the weights (whatever ``on_nonfinite`` says)."""
        grads = [p.grad.detach() for p in self.model.parameters() if p.grad is not None]
        if grads and not torch.isfinite(torch.stack([g.norm() for g in grads]).sum()):
            raise self._nonfinite_error("the gradient")

    def _end_of_step(self, step: int) -> None:
        step_loss, step_tokens = self._step_sums("cluster")
        self.cluster_loss_sum += step_loss
        self.cluster_tokens += step_tokens
        if self.sampler is not None:
            self.sampler.observe(step, step_loss.cpu().numpy(), step_tokens.cpu().numpy())
        total = step_tokens.sum()
        step_mean = (step_loss.sum() / total.clamp(min=1)).float()
        self.last_loss = float(step_mean)  # for the progress line
        self.log("train/loss", step_mean, prog_bar=True, on_step=True, batch_size=1, rank_zero_only=True)
        self.log("train/tokens", self.cluster_tokens.sum().double(), on_step=True, batch_size=1, rank_zero_only=True)
        if "group" in self._open:
            group_loss, group_tokens = self._step_sums("group")
            self.group_loss_sum += group_loss
            self.group_tokens += group_tokens
        for loss, tokens in self._open.values():
            loss.zero_()
            tokens.zero_()

    @property
    def tokens_seen(self) -> int:
        """Target tokens trained on so far, all ranks together."""
        return int(self.cluster_tokens.sum())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip the gradient norm to ``trainer.gradient_clip_val`` (``None``: off). Under FSDP the norm is the
        sharded module's own ``clip_grad_norm_`` (the norm over every rank's shards): Lightning's FSDP precision
        plugin refuses ``gradient_clip_algorithm='norm'`` (MisconfigurationException, seen on an H200 with
        Lightning 2.6.6); elsewhere Lightning's own clipping."""
        sharded = getattr(getattr(self.trainer, "strategy", None), "model", None)
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and hasattr(sharded, "clip_grad_norm_"):
            sharded.clip_grad_norm_(float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=self.lr, betas=self.betas)

        def schedule(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
