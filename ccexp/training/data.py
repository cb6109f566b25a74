"""The sampler-driven data module: the sampling policy, not a DistributedSampler, orders the data.

Each item of the training "dataset" is one *micro-batch*: ``micro_batch_size`` rows of ``seq_len``
tokens of this rank's share of one optimizer step of the global token stream
([`ccexp.data.packing.TokenStream`][ccexp.data.packing.TokenStream]). Item ``i`` is micro-batch ``i mod A`` of step ``i div A``
(``A`` = gradient accumulation), and Lightning steps the optimizer every ``A`` items. The
DataLoader runs in the main process (``num_workers=0``) so the policy's state, its ``observe()``
feedback and its checkpointed ``state_dict()`` all live in one place.
"""
from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ccexp.data.packing import StepPlan, TokenStream
from ccexp.sampling import rank_slice


class MicroBatchDataset(Dataset):
    """``dataset[i]`` -> this rank's micro-batch ``i mod A`` of step ``i div A`` (steps come in order)."""

    def __init__(self, module: "SamplerDataModule"):
        self.m = module

    def __len__(self) -> int:
        return self.m.total_steps * self.m.grad_accumulation

    def __getitem__(self, index: int) -> dict[str, Any]:
        m = self.m
        step, micro = divmod(int(index), m.grad_accumulation)
        plan = m.plan(step)
        mine = rank_slice(np.arange(m.stream.rows_per_step), m.rank, m.world_size)
        rows = mine[micro * m.micro_batch_size:(micro + 1) * m.micro_batch_size]
        batch = m.stream.rows(plan, rows, tokens=m.tokens, offsets=m.offsets, corpus_index=m.train_docs,
                              eos_id=m.eos_id, document_mask=m.document_mask, prompt_tokens=m.prompt_tokens,
                              groups=m.groups)
        batch.update(step=step, micro=micro, last_micro=micro == m.grad_accumulation - 1,
                     rows=torch.from_numpy(rows))
        return batch


class _RemainingMicroBatches:
    """The DataLoader's index sampler: ``len`` is the whole run (Lightning counts the micro-batches
    already trained before a resume as part of the epoch); iteration starts at the first micro-batch
    of the first step not yet trained (0, or the resumed step)."""

    def __init__(self, module: "SamplerDataModule"):
        self.m = module

    def __len__(self) -> int:
        return self.m.total_steps * self.m.grad_accumulation

    def __iter__(self):
        trainer = self.m.trainer
        first = trainer.global_step if trainer is not None else min(self.m.plans, default=self.m.stream.step)
        return iter(range(first * self.m.grad_accumulation, len(self)))


class SamplerDataModule(L.LightningDataModule):
    """Feeds Lightning fixed-shape micro-batches of the global token stream, in the policy's order.

    Args:
        stream: the token stream over the sampler's documents.
        train_docs: int64[N_train] corpus index of each of the sampler's documents.
        tokens, offsets: the tokenized corpus (see [`ccexp.data.tokenize.encode_corpus`][ccexp.data.tokenize.encode_corpus]).
        total_steps: optimizer steps in the run.
        micro_batch_size: rows per forward pass per rank.
        grad_accumulation: micro-batches per optimizer step per rank.
        eos_id: the document separator.
        document_mask: give each row per-document ``position_ids`` (intra-document attention).
        prompt_tokens: instruction data, int64[N] prompt tokens per corpus document: batches carry a
            ``loss_mask`` so only response tokens are trained on.
        groups: int64[N] value id of a label (the first of ``data.label_fields``) per corpus document:
            batches carry ``group_ids`` for per-label accounting.
    """

    def __init__(self, stream: TokenStream, train_docs: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, *,
                 total_steps: int, micro_batch_size: int, grad_accumulation: int, eos_id: int,
                 document_mask: bool = False, prompt_tokens: np.ndarray | None = None,
                 groups: np.ndarray | None = None):
        super().__init__()
        self.stream = stream
        self.prompt_tokens, self.groups = prompt_tokens, groups
        self.train_docs = np.asarray(train_docs, dtype=np.int64)
        self.tokens, self.offsets = tokens, offsets
        self.total_steps, self.micro_batch_size = int(total_steps), int(micro_batch_size)
        self.grad_accumulation, self.eos_id, self.document_mask = int(grad_accumulation), int(eos_id), bool(document_mask)
        self.rank, self.world_size = 0, 1
        # plans of steps the DataLoader has started (Lightning prefetches) but the loop has not finished;
        # they go into checkpoints so that a resumed run trains on exactly the same tokens
        self.plans: dict[int, StepPlan] = {}

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size

    def plan(self, step: int) -> StepPlan:
        """Step ``step``'s plan: kept while its micro-batches are served, drawn when first asked for."""
        if step not in self.plans:
            if step != self.stream.step:
                raise RuntimeError(f"the token stream is at step {self.stream.step}, asked for step {step}")
            self.plans[step] = self.stream.plan_step()
            for old in [t for t in self.plans if t < step - 2]:  # keep the few steps that may be in flight
                del self.plans[old]
        return self.plans[step]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(MicroBatchDataset(self), batch_size=None, sampler=_RemainingMicroBatches(self), num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's and the stream's state plus the plans of steps drawn but not yet trained."""
        trained = self.trainer.global_step if self.trainer is not None else 0
        self.plans = {t: p for t, p in self.plans.items() if t >= trained}
        return _to_torch({"sampler": self.stream.sampler.state_dict(), "stream": self.stream.state_dict(),
                          "plans": {t: p.state() for t, p in self.plans.items()}})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = _to_numpy(state)
        self.stream.sampler.load_state_dict(state["sampler"])
        self.stream.load_state_dict(state["stream"])
        self.plans = {int(t): StepPlan.from_state(p) for t, p in state.get("plans", {}).items()}


def _to_torch(obj: Any) -> Any:
    """NumPy arrays -> tensors, so checkpoints load with ``torch.load(weights_only=True)``."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    return obj


def _to_numpy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    return obj
