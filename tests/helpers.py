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
