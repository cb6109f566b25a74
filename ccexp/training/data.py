"""The sampler-driven data module: the sampling policy, not a DistributedSampler, orders the data.

Each item of the training "dataset" is one optimizer step: the policy's global batch for that step,
sliced to this rank (:func:`ccexp.sampling.rank_slice`) and packed into sequences. The DataLoader
runs in the main process (``num_workers=0``) so the policy's state, its ``observe()`` feedback and
its checkpointed ``state_dict()`` all live in one place.
"""
from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
from torch.utils.data import DataLoader, Dataset

from ccexp.data.packing import pack_documents
from ccexp.sampling import Sampler, rank_slice


class StepDataset(Dataset):
    """``dataset[step]`` -> this rank's packed batch for ``step`` (calls must come in step order)."""

    def __init__(self, module: "SamplerDataModule"):
        self.m = module

    def __len__(self) -> int:
        return self.m.total_steps

    def __getitem__(self, step: int) -> dict[str, Any]:
        m = self.m
        docs = m.sampler.next_global_batch(step)
        mine = rank_slice(docs, m.rank, m.world_size)
        batch = pack_documents(m.train_docs[mine], m.tokens, m.offsets, m.doc_clusters, seq_len=m.seq_len,
                               max_doc_tokens=m.max_doc_tokens, eos_id=m.eos_id, pad_id=m.pad_id)
        batch["step"] = step
        return batch


class SamplerDataModule(L.LightningDataModule):
    """Feeds Lightning one packed batch per optimizer step, in the order the sampler chooses.

    Args:
        sampler: the policy, built over the training documents (its indices ``i`` map to corpus
            documents ``train_docs[i]``).
        train_docs: int64[N_train] corpus index of each training document.
        tokens, offsets: the tokenized corpus (see :func:`ccexp.data.tokenize.encode_corpus`).
        doc_clusters: int64[N_corpus] cluster id of every corpus document.
        total_steps: optimizer steps in the run.
    """

    def __init__(self, sampler: Sampler, train_docs: np.ndarray, tokens: np.ndarray, offsets: np.ndarray,
                 doc_clusters: np.ndarray, *, total_steps: int, seq_len: int, max_doc_tokens: int, eos_id: int,
                 pad_id: int):
        super().__init__()
        self.sampler = sampler
        self.train_docs = np.asarray(train_docs, dtype=np.int64)
        self.tokens, self.offsets = tokens, offsets
        self.doc_clusters = np.asarray(doc_clusters, dtype=np.int64)
        self.total_steps, self.seq_len, self.max_doc_tokens = int(total_steps), int(seq_len), int(max_doc_tokens)
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.rank, self.world_size = 0, 1

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size

    def train_dataloader(self) -> DataLoader:
        start = self.sampler.state_dict()["step"]  # > 0 after resuming from a checkpoint
        return DataLoader(StepDataset(self), batch_size=None, sampler=range(start, self.total_steps), num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
