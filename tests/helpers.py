"""Test helpers: markers for tests that need hardware this machine may not have (lightning-hydra-template's RunIf)."""
from __future__ import annotations

import pytest


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


requires_gpu = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
