"""Tokenizers (a byte-level BPE trained locally with ``tokenizers``, or a local pretrained one) and
corpus tokenization into a flat token array with offsets."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from itertools import chain
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
    token before every document ([`separator_id`][ccexp.data.tokenize.TokenizedCorpus.separator_id])."""

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


PIECE_CHARS = 1 << 16  # a text longer than this is tokenized in pieces (memory: a piece's encodings)


def check_tokenizer_kind(kind: str) -> None:
    """Raises CcexpError unless ``kind`` (``model.tokenizer.kind``) is ``bpe`` or ``pretrained``."""
    if kind not in ("bpe", "pretrained"):
        raise CcexpError(f"model.tokenizer.kind={kind!r} is not an option; use bpe or pretrained")


def text_pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of at most about ``limit`` characters, each cut just before a single space
    between two words — where a byte-level pre-tokenizer splits anyway — so that tokenizing the pieces
    one by one gives the same ids as tokenizing ``text`` whole with a byte-level BPE (ccexp's own, GPT-2's,
    SmolLM2's), while a tokenizer's memory is that of one piece: the Rust tokenizers keep several hundred
    bytes per word, 4 GB for one 45 MB document. (A SentencePiece-style tokenizer that marks the start
    of its input may read one token differently at a cut: one per ``limit`` characters.) A stretch of
    ``limit`` characters without such a space is cut where it ends."""
    if len(text) <= limit:
        return [text]
    out, start = [], 0
    while len(text) - start > limit:
        end = start + limit
        cut = end
        while cut > start + limit // 2 and not (text[cut] == " " and not text[cut - 1].isspace()
                                                and cut + 1 < len(text) and not text[cut + 1].isspace()):
            cut -= 1
        cut = cut if cut > start + limit // 2 else end
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


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
    tk.train_from_iterator((piece for text in texts for piece in text_pieces(text)), trainer=trainer)
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


def encode_corpus(tok, texts: list[str], batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize every document (no special tokens), ``batch`` documents at a time: a fast tokenizer's
    Rust backend (``encode_batch_fast``: no character offsets; the same ids as ``tok(texts)``), else
    ``tok`` itself. Memory is one batch's encodings, not the corpus's; a long document is encoded in
    [`text_pieces`][ccexp.data.tokenize.text_pieces].

    Returns:
        ``tokens`` int32[T] (all documents concatenated) and ``offsets`` int64[N+1] such that
        document d is ``tokens[offsets[d]:offsets[d+1]]``.
    """
    backend = getattr(tok, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    pieces: list[np.ndarray] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    def encode(docs: list[str]) -> list[list[int]]:
        if fast is not None:
            return [e.ids for e in fast(docs, add_special_tokens=False)]
        return tok(docs, add_special_tokens=False)["input_ids"]

    for start in range(0, len(texts), batch):
        docs = texts[start:start + batch]
        if any(len(t) > PIECE_CHARS for t in docs):  # one document at a time, a long one piece by piece
            for k, text in enumerate(docs):
                ids = np.concatenate([np.asarray(x, dtype=np.int32) for x in
                                      (encode([p])[0] for p in text_pieces(text))] or [np.zeros(0, np.int32)])
                lengths[start + k] = ids.size
                pieces.append(ids)
            continue
        enc = encode(docs)
        lengths[start:start + len(enc)] = [len(ids) for ids in enc]
        pieces.append(np.fromiter(chain.from_iterable(enc), dtype=np.int32,
                                  count=int(lengths[start:start + len(enc)].sum())))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return tokens, offsets


def encode_instructions(tok, texts: list[str], prompt_chars: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize instruction documents (``text = prompt + response``, the prompt being the first
    ``prompt_chars[d]`` characters) with prompt and response encoded apart.

    Returns:
        ``tokens`` int32[T], ``offsets`` int64[N+1] (as [`encode_corpus`][ccexp.data.tokenize.encode_corpus]) and ``prompt_tokens``
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


def tokenize_shards(tok, texts, prompt_chars: np.ndarray | None, work_dir: Path, *, shard_documents: int,
                    rank: int = 0, world_size: int = 1) -> dict:
    """Tokenize this rank's unfinished shards (documents ``[i·S, (i+1)·S)``, ``S = shard_documents``; rank r
    takes shards ``i ≡ r (mod W)``) into ``work_dir``: ``tokens-<i>.npy`` (int32), ``lengths-<i>.npy``
    (int64 tokens per document) and, for instruction data, ``prompt-<i>.npy`` (int64 prompt tokens),
    then a ``tokens-<i>.done`` marker — so a killed run resumes with the unfinished shards, and memory is
    one shard's tokens whatever the corpus size.

    Args:
        tok: a Hugging Face tokenizer; texts: N documents (a list or a shard-backed column, sliced per shard);
        prompt_chars: int64[N] prompt characters of instruction documents, or None.

    Returns:
        ``{"tokenized": [...], "skipped": [...]}``: the shard numbers done now and found done.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    n_shards = -(-len(texts) // shard_documents)
    span = {i: (i * shard_documents, min(len(texts), (i + 1) * shard_documents))
            for i in range(rank, n_shards, world_size)}  # this rank's shards: their documents [a, b)
    # finished for this shard size: a marker holds its shard's document count
    skipped = [i for i, (a, b) in span.items() if (m := work_dir / f"tokens-{i:06d}.done").is_file()
               and m.read_text().strip() == str(b - a)]
    todo = sorted(set(span) - set(skipped))
    if skipped:
        log.info("tokenize: resuming, %d of %d shards already done", len(skipped), len(span))
    t0, docs, toks = time.perf_counter(), 0, 0
    docs_todo = sum(span[i][1] - span[i][0] for i in todo)
    for n, i in enumerate(todo, start=1):
        a, b = span[i]
        part = texts[a:b]
        if prompt_chars is None:
            tokens, offsets = encode_corpus(tok, part)
        else:
            tokens, offsets, prompt = encode_instructions(tok, part, prompt_chars[a:b])
            _save(work_dir / f"prompt-{i:06d}.npy", prompt)
        _save(work_dir / f"tokens-{i:06d}.npy", tokens)
        _save(work_dir / f"lengths-{i:06d}.npy", np.diff(offsets))
        (work_dir / f"tokens-{i:06d}.done").write_text(f"{b - a}\n")
        docs, toks = docs + b - a, toks + tokens.size
        rate = docs / max(time.perf_counter() - t0, 1e-9)
        log.info("tokenize: shard %d/%d%s, %s of %s documents, %s tokens, %.0f docs/s, ETA %.0f s", n, len(todo),
                 f" (rank {rank})" if world_size > 1 else "", f"{docs:,}", f"{docs_todo:,}", f"{toks:,}", rate,
                 (docs_todo - docs) / rate)
    return {"tokenized": todo, "skipped": skipped}


def _save(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` whole or not at all (a temporary name, then a rename)."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def assemble_tokens(work_dir: Path, n_docs: int, shard_documents: int, out_dir: Path) -> dict:
    """Join the shards of [`tokenize_shards`][ccexp.data.tokenize.tokenize_shards] into ``out_dir``: ``tokens.npy`` (int32[T], appended one
    shard at a time), ``offsets.npy`` (int64[N+1]) and, for instruction data,
    ``prompt_tokens.npy`` (int64[N]).

    Returns:
        ``{"documents": N, "tokens": T}``.
    """
    n_shards = -(-n_docs // shard_documents)
    lengths = np.concatenate([np.load(work_dir / f"lengths-{i:06d}.npy") for i in range(n_shards)])
    if lengths.size != n_docs:
        raise CcexpError(f"tokenize: the shards in {work_dir} hold {lengths.size} documents, not {n_docs}; delete that "
                         "folder and run again")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with open(out_dir / "tokens.npy", "wb") as f:  # plain writes: a memory map's dirty pages would count as RSS
        np.lib.format.write_array_header_2_0(f, {"descr": np.dtype(np.int32).str, "fortran_order": False,
                                                 "shape": (int(offsets[-1]),)})
        for i in range(n_shards):
            np.load(work_dir / f"tokens-{i:06d}.npy").astype(np.int32, copy=False).tofile(f)
    np.save(out_dir / "offsets.npy", offsets)
    if (work_dir / "prompt-000000.npy").is_file():
        np.save(out_dir / "prompt_tokens.npy",
                np.concatenate([np.load(work_dir / f"prompt-{i:06d}.npy") for i in range(n_shards)]))
    return {"documents": n_docs, "tokens": int(offsets[-1])}
