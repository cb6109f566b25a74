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
import torch
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
        docs = m.drawn_ahead.pop(step, None)
        if docs is None:
            # Lightning may re-create the iterator (it does when resuming), asking again for a step
            # whose batch was already drawn: serve it again rather than drawing a new one
            docs = m.drawn.get(step)
        if docs is None:
            docs = m.sampler.next_global_batch(step)
        m.drawn[step] = docs
        for old in [t for t in m.drawn if t < step - 3]:  # keep the few batches that may be in flight
            del m.drawn[old]
        mine = rank_slice(docs, m.rank, m.world_size)
        batch = pack_documents(m.train_docs[mine], m.tokens, m.offsets, m.doc_clusters, seq_len=m.seq_len,
                               max_doc_tokens=m.max_doc_tokens, eos_id=m.eos_id, pad_id=m.pad_id)
        batch["step"] = step
        batch["docs"] = mine
        return batch


class _RemainingSteps:
    """The DataLoader's index sampler: ``len`` is the whole run (Lightning counts the steps already
    trained before a resume as part of the epoch); iteration starts at the first step not yet
    trained (0, or the resumed step)."""

    def __init__(self, module: "SamplerDataModule"):
        self.m = module

    def __len__(self) -> int:
        return self.m.total_steps

    def __iter__(self):
        start = min(self.m.drawn_ahead, default=self.m.sampler.state_dict()["step"])
        return iter(range(start, self.m.total_steps))


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
        # global batches the DataLoader has drawn (Lightning prefetches) but the loop has not trained on
        # yet; they go into checkpoints so that a resumed run trains on exactly the same stream
        self.drawn: dict[int, np.ndarray] = {}
        self.drawn_ahead: dict[int, np.ndarray] = {}

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StepDataset(self), batch_size=None, sampler=_RemainingSteps(self), num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state plus the global batches already drawn for steps not yet trained."""
        trained = self.trainer.global_step if self.trainer is not None else 0
        self.drawn = {t: d for t, d in self.drawn.items() if t >= trained}
        return _to_torch({"sampler": self.sampler.state_dict(), "drawn_ahead": dict(self.drawn)})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = _to_numpy(state)
        self.sampler.load_state_dict(state["sampler"])
        self.drawn_ahead = dict(state.get("drawn_ahead", {}))


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
