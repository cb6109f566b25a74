"""Tokenizers (a byte-level BPE trained locally with ``tokenizers``, or a local pretrained one) and
corpus tokenization into a flat token array with offsets."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")
EOS = "<|endoftext|>"


@dataclass
class TokenizedCorpus:
    """tokens: int32[T] (memory-mapped); offsets: int64[N+1] (document d is
    ``tokens[offsets[d]:offsets[d+1]]``); tokenizer: the Hugging Face tokenizer; separator_id: the
    token before every document (:func:`separator_id`)."""

    tokens: np.ndarray
    offsets: np.ndarray
    tokenizer: object
    separator_id: int = -1  # the token put before every document in the packed stream (-1: the tokenizer's EOS)
    prompt_tokens: np.ndarray | None = None  # instruction data: int64[N] leading prompt tokens (not trained on)

    def __post_init__(self):
        if self.separator_id < 0:
            self.separator_id = int(self.tokenizer.eos_token_id)

    def lengths(self, docs: np.ndarray) -> np.ndarray:
        """int64[n]: tokens of each document in ``docs``."""
        return self.offsets[docs + 1] - self.offsets[docs]


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE tokenizer (GPT-2 style, one special token ``<|endoftext|>``) and save it
    with ``save_pretrained`` in ``out_dir``. Returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise CcexpError(f"model.tokenizer.vocab_size={vocab_size} is too small for a byte-level BPE (>= 300)")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)
    tok.save_pretrained(str(out_dir))
    return tok


def load_tokenizer(path: str | Path):
    """Load a tokenizer saved with ``save_pretrained`` (local files only, no hub access).

    Raises:
        CcexpError: if nothing loadable is at ``path``.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CcexpError(f"no tokenizer at {str(path)!r} ({str(e).splitlines()[0][:120]}); give a local "
                         "model directory (ccexp never downloads at run time)") from None
    if tok.eos_token_id is None:
        raise CcexpError(f"the tokenizer at {path} has no EOS token; ccexp separates packed documents with EOS")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def separator_id(tok, separator: str | None = None) -> int:
    """The token put before every document of the packed stream: ``separator`` when given, else the
    tokenizer's BOS when it adds one to every input (Llama-style ``add_bos_token``), else its EOS.

    Raises:
        CcexpError: if ``separator`` is not a single token of this tokenizer's vocabulary.
    """
    if separator:
        sid = tok.convert_tokens_to_ids(separator)
        if sid is None or sid == tok.unk_token_id and separator != tok.unk_token:
            raise CcexpError(f"model.tokenizer.separator={separator!r} is not a token of this tokenizer; give one "
                             f"of its special tokens: {', '.join(tok.all_special_tokens[:8])}")
        return int(sid)
    if getattr(tok, "add_bos_token", False) and tok.bos_token_id is not None:
        return int(tok.bos_token_id)
    return int(tok.eos_token_id)


def encode_corpus(tok, texts: list[str], batch: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize every document (no special tokens).

    Returns:
        ``tokens`` int32[T] (all documents concatenated) and ``offsets`` int64[N+1] such that
        document d is ``tokens[offsets[d]:offsets[d+1]]``.
    """
    pieces: list[np.ndarray] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for start in range(0, len(texts), batch):
        enc = tok(texts[start:start + batch], add_special_tokens=False)["input_ids"]
        for k, ids in enumerate(enc):
            lengths[start + k] = len(ids)
        pieces.append(np.fromiter((t for ids in enc for t in ids), dtype=np.int32))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return tokens, offsets


def encode_instructions(tok, texts: list[str], prompt_chars: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize instruction documents (``text = prompt + response``, the prompt being the first
    ``prompt_chars[d]`` characters) with prompt and response encoded apart.

    Returns:
        ``tokens`` int32[T], ``offsets`` int64[N+1] (as :func:`encode_corpus`) and ``prompt_tokens``
        int64[N]: document d's first ``prompt_tokens[d]`` tokens are its prompt.
    """
    cut = np.asarray(prompt_chars, dtype=np.int64)
    p_tok, p_off = encode_corpus(tok, [t[:c] for t, c in zip(texts, cut)])
    r_tok, r_off = encode_corpus(tok, [t[c:] for t, c in zip(texts, cut)])
    p_len, r_len = np.diff(p_off), np.diff(r_off)
    offsets = np.concatenate([[0], np.cumsum(p_len + r_len)]).astype(np.int64)
    tokens = np.empty(int(offsets[-1]), dtype=np.int32)
    # document d: its prompt tokens, then its response tokens
    d_p = np.repeat(np.arange(len(texts)), p_len)
    tokens[offsets[d_p] + (np.arange(p_tok.size) - p_off[d_p])] = p_tok
    d_r = np.repeat(np.arange(len(texts)), r_len)
    tokens[offsets[d_r] + p_len[d_r] + (np.arange(r_tok.size) - r_off[d_r])] = r_tok
    return tokens, offsets, p_len.astype(np.int64)
