"""Model builders: a small GPT trained from scratch, or a local Hugging Face causal LM."""
from __future__ import annotations

from pathlib import Path

from ccexp.errors import CcexpError
from ccexp.training.distributed import empty_model


def tiny_gpt(vocab_size: int, eos_id: int, n_layer: int = 2, n_embd: int = 128, n_head: int = 4,
             n_positions: int = 512, dropout: float = 0.0):
    """A GPT-2 architecture (``transformers.GPT2LMHeadModel``) with random initialisation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if n_embd % n_head:
        raise CcexpError(f"model.n_embd={n_embd} must be divisible by model.n_head={n_head}")
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                     bos_token_id=eos_id, eos_token_id=eos_id)  # no pad token: the token stream is never padded
    return GPT2LMHeadModel(cfg)


def hf_causal_lm(pretrained: str, dtype: str = "float32", gradient_checkpointing: bool = False,
                 vocab_size: int | None = None, eos_id: int | None = None, empty: bool = False):
    """Load a causal LM from a local folder or the local Hugging Face cache (never downloads).

    ``vocab_size`` and ``eos_id`` (from the tokenizer stage) are accepted for a uniform call and unused.
    ``empty``: build the architecture without reading weights, its parameters on the meta device and its buffers
    computed for real ([`ccexp.training.distributed.empty_model`][ccexp.training.distributed.empty_model]): FSDP ranks
    other than 0, whose parameter values are broadcast from rank 0.

    Raises:
        CcexpError: if the model is not available locally.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if empty:
            config = AutoConfig.from_pretrained(pretrained, local_files_only=True)
            model = empty_model(lambda: AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)))
        else:
            model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=getattr(torch, dtype), local_files_only=True)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())[:300]
        if Path(pretrained).expanduser().exists():
            raise CcexpError(f"model.pretrained={pretrained!r}: cannot load this folder ({reason}); it must hold a "
                             "causal LM saved with save_pretrained (config.json and its weights)") from None
        raise CcexpError(f"model.pretrained={pretrained!r}: cannot load this model id offline, it is not in the local "
                         f"HF cache ({reason}); download it beforehand (`huggingface-cli download {pretrained}`) or "
                         "give a local folder") from None
    model.train()  # from_pretrained returns eval mode: no dropout, and no gradient checkpointing, in training
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model
