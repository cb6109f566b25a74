"""CluSTER's gradient-proxy embedding (Kim et al., kaist-dmlab/CluSTER,
its step 1): a document's embedding is the gradient of its loss with respect to the output-embedding
rows, projected BADGE-style onto the last hidden state,

    g = mean over target tokens t of (p_θ(y_t | x_<t) − 1) · h_t  ∈ R^H,  then L2-normalised,

where ``h_t`` is the model's last hidden state at the position predicting ``y_t`` and the target
tokens are the response tokens of instruction data (every token of a plain document). No LoRA and
no random projection, as in the reference code. The embedding runs in the same resumable shards as
the sentence embedder ([`ccexp.embedding.shards`][ccexp.embedding.shards]), spread over the ranks of a torchrun/srun
launch, and is cached by the ``embed`` stage.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ccexp.embedding.shards import embed_and_assemble, launch_device
from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


class GradientProxyEmbedder:
    """Gradient-proxy embeddings from a causal LM; see the module docstring.

    Args:
        model: ``model`` (the run's own ``model.pretrained``, passed in as ``pretrained``), or a local
            Hugging Face folder / ``pkg:`` GGUF spec resolved the same way.
        batch_size: documents per forward pass.
        max_seq_length: tokens read per document (prompt + response, the first ones; a document
            whose response starts beyond it is embedded from all of its tokens in the window).
        device: ``cpu``, ``cuda``, ``cuda:1``... or ``auto``.
        shard_size: documents per shard (the unit of progress, resume and rank assignment).
        dtype: the model's dtype while embedding (``float32``, ``bfloat16``, ``float16``).
        pretrained: the local folder to load (the run's model folder from the ``model`` stage when
            ``model=model``, else ``model`` resolved by the embed stage); overrides ``model``.

    Raises:
        CcexpError: for a setting out of range, or ``model=model`` in a run without a pretrained model.
    """

    long_documents = "first_tokens"  # a document longer than max_seq_length tokens is read from its beginning

    def __init__(self, model: str = "model", batch_size: int = 16, max_seq_length: int = 512, device: str = "auto",
                 shard_size: int = 256, dtype: str = "float32", pretrained: str | None = None):
        for key, value in (("batch_size", batch_size), ("max_seq_length", max_seq_length), ("shard_size", shard_size)):
            if int(value) < 2 if key == "max_seq_length" else int(value) < 1:
                raise CcexpError(f"embedder.{key}={value} is out of range")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise CcexpError(f"embedder.dtype={dtype!r} is not an option; use float32, bfloat16 or float16")
        self.model_spec, self.pretrained = model, pretrained
        self.batch_size, self.max_seq_length, self.shard_size = int(batch_size), int(max_seq_length), int(shard_size)
        self.device, self.dtype = device, dtype
        self._model = self._tokenizer = None

    def _source(self) -> str:
        if self.pretrained:  # the run's model folder, or embedder.model resolved by the embed stage
            return self.pretrained
        if self.model_spec != "model" and Path(self.model_spec).expanduser().is_dir():
            return str(Path(self.model_spec).expanduser())
        raise CcexpError("embedder=gradient_proxy needs a model: embedder.model=model with a pretrained run model "
                         "(model=hf_causal_lm model.pretrained=...), or embedder.model=<a local HF folder>")

    def _load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM

        from ccexp.data.tokenize import load_tokenizer

        source = self._source()
        device = launch_device(self.device)
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, self.dtype), local_files_only=True)
        except (OSError, ValueError) as e:
            raise CcexpError(f"embedder=gradient_proxy: cannot load the model at {source!r} offline "
                             f"({str(e).splitlines()[0][:100]})") from None
        self._tokenizer = load_tokenizer(source)
        self._model = model.to(device).eval()

    def encode(self, items: list[tuple[str, int]]) -> tuple[np.ndarray, int]:
        """float32[n, H] L2-normalised gradient proxies of ``(text, prompt_chars)`` items, and how many
        documents were longer than ``max_seq_length`` tokens (read from their beginning only)."""
        import torch

        if self._model is None:
            self._load()
        tok, model = self._tokenizer, self._model
        device = next(model.parameters()).device
        out = np.zeros((len(items), model.config.hidden_size), dtype=np.float32)
        long = 0
        import time

        t0 = last = time.perf_counter()
        for start in range(0, len(items), self.batch_size):
            if time.perf_counter() - last >= 10.0:  # a forward pass of a real LM per batch: show it moving
                last = time.perf_counter()
                rate = start / (last - t0)
                log.info("embed: gradient proxy, %d of %d documents of this shard, %.1f docs/s, ETA %.0f s", start,
                         len(items), rate, (len(items) - start) / max(rate, 1e-9))
            chunk = items[start:start + self.batch_size]
            prompts = tok([t[:c] for t, c in chunk], add_special_tokens=False)["input_ids"]
            responses = tok([t[c:] for t, c in chunk], add_special_tokens=False)["input_ids"]
            seqs = [([tok.eos_token_id] + p + r)[:self.max_seq_length] for p, r in zip(prompts, responses)]
            long += sum(1 + len(p) + len(r) > self.max_seq_length for p, r in zip(prompts, responses))
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(seqs), width), dtype=torch.long)
            target = torch.zeros((len(seqs), width - 1), dtype=torch.bool)  # position t predicts token t+1
            for i, (s, p) in enumerate(zip(seqs, prompts)):
                ids[i, :len(s)] = torch.tensor(s)
                attn[i, :len(s)] = 1
                first = min(1 + len(p), len(s) - 1)  # the first response token (or the last token)
                target[i, max(first, 1) - 1:len(s) - 1] = True
            ids, attn, target = ids.to(device), attn.to(device), target.to(device)
            with torch.no_grad():
                res = model(input_ids=ids, attention_mask=attn, output_hidden_states=True, use_cache=False)
                logp = torch.log_softmax(res.logits[:, :-1].float(), dim=-1)
                p_true = logp.gather(-1, ids[:, 1:, None]).squeeze(-1).exp()  # [B, L-1]
                h = res.hidden_states[-1][:, :-1].float()  # [B, L-1, H]
                coef = (p_true - 1.0) * target  # zero off the targets
                g = (coef[..., None] * h).sum(1) / target.sum(1, keepdim=True).clamp(min=1)
                g = torch.nn.functional.normalize(g, dim=-1)
            out[start:start + len(chunk)] = g.cpu().numpy()
        return out, long

    def embed(self, texts: list[str], out_path: Path, work_dir: Path | None = None, *, rank: int = 0,
              world_size: int = 1, prompt_chars: np.ndarray | None = None) -> tuple[np.ndarray | None, dict]:
        """Embed ``texts`` (``prompt_chars``: int64[N] prompt characters of instruction documents) shard
        by shard into ``work_dir``, then on rank 0 assemble float16[N, H] at ``out_path``; as
        [`ccexp.embedding.sentence.SentenceEmbedder.embed`][ccexp.embedding.sentence.SentenceEmbedder.embed].

        Raises:
            CcexpError: if the model cannot be loaded or yields a non-finite embedding.
        """
        cuts = np.zeros(len(texts), dtype=np.int64) if prompt_chars is None else np.asarray(prompt_chars)
        return embed_and_assemble(self.encode, list(zip(texts, cuts.tolist())), out_path, work_dir,
                                  shard_size=self.shard_size, rank=rank, world_size=world_size)
