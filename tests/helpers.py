"""Test helpers: markers for tests that need hardware this machine may not have (lightning-hydra-template's RunIf)."""
from __future__ import annotations

import pytest


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


requires_gpu = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")


def clustered_documents(sizes, seed=0):
    """Cluster labels (int32[N], shuffled) for clusters of ``sizes`` documents, and the sizes (int64[K])."""
    import numpy as np

    sizes = np.asarray(sizes, dtype=np.int64)
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(sizes.size), sizes)).astype(np.int32)
    return labels, sizes


def source_mixture_factory(inner, weights=(0.6, 0.0, 0.4), **inner_kw):
    """A constructor ``make(labels, sizes, *, block_size, seed, ...)`` shaped like a policy class's,
    building :class:`~ccexp.sampling.SourceMixture` over ``len(weights)`` sources (document ``i`` in
    source ``i mod S``, ``1 + 7i mod 13`` tokens unless given) with ``inner(**inner_kw)`` in each source,
    so the shared policy tests can run it."""
    import functools

    import numpy as np

    from ccexp.sampling import SourceMixture

    def make(labels, sizes, *, block_size=64, seed=0, document_tokens=None, token_budget=None):
        n = len(labels)
        tokens = 1 + (7 * np.arange(n)) % 13 if document_tokens is None else document_tokens
        return SourceMixture(labels, sizes, sources=np.arange(n) % len(weights), source_weights=list(weights),
                             inner=functools.partial(inner, **inner_kw), block_size=block_size, seed=seed,
                             document_tokens=tokens, token_budget=token_budget)

    make.__name__ = f"SourceMixture[{getattr(inner, '__name__', inner)}]"
    return make


class StopAfterSteps:
    """A Lightning callback that stops training after ``steps`` optimizer steps *of this launch* (so each
    resume goes ``steps`` further): the deterministic stand-in for a wall-clock timer in tests."""

    def __new__(cls, steps: int):
        from lightning.pytorch.callbacks import Callback

        class _Stop(Callback):
            def __init__(self):
                self.left = int(steps)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if bool(batch["last_micro"]):
                    self.left -= 1
                    if self.left <= 0:
                        trainer.should_stop = True

        return _Stop()


def wandb_records(path):
    """The records of a W&B run's transaction log (``run-<id>.wandb``, what ``wandb sync`` uploads), as
    ``wandb_internal_pb2.Record``: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB's log
    format (32 KiB blocks of records: CRC32, length, type FULL/FIRST/MIDDLE/LAST, data)."""
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), "not a W&B transaction log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        if kind == 0 and length == 0:
            break
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"a damaged record at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL, LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
