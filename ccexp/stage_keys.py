"""What each cached stage's output depends on — its key — written out in one place (the Marin executor's
rule: a step is its config plus its inputs, and its output path is their hash).

| stage | its settings | its inputs |
|---|---|---|
| corpus | ``data.*`` except ``name`` and ``path`` | the source's bytes (a file, or every file of a ``datasets`` folder); for a URL, each object's ETag / version id and size, as its store reports them |
| embed | ``embedder.*`` except ``name``, ``device``, ``batch_size`` | the corpus's content; the embedding model folder's bytes, or the run's model (gradient proxy) |
| cluster | ``clusterer.*`` except ``name``, ``verbose``, ``assign_batch`` | the embedding; the corpus's content (its held-out split); the label values (the cluster report) |
| dedup | ``curate.dedup.*`` | the clustering (and through it the embedding and the split); the label values (its report) |
| model | — | the GGUF file's bytes |
| tokenize | ``model.tokenizer``'s kind, vocabulary size and separator | the corpus's content; the model stage; the tokenizer folder's bytes |
| reference | its training run's: model, trainer numerics, the ``train.*`` that shape the stream and the optimiser, seeds, steps, documents scored, ``eval.max_tokens`` | the corpus, clustering, tokenizer and model stages; the model's weights; the training split it trains on |

Every key also holds the code that computes its stage — [`code_digest`][ccexp.stage_keys.code_digest], over the abstract syntax
trees of the modules that compute it, so a comment or a docstring changes nothing while any change to
the algorithm does (no hand-kept version number) — and the versions of the libraries whose numbers
reach its output. Settings that do not change the output (``embedder.batch_size``, a device, logging)
stay out, so changing them reuses the stage.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
from importlib import metadata, util
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ccexp.artifacts import file_digest, fingerprint

# the code that computes each stage: whole modules, or ``module:Qualified.name`` for one function or method
# (its syntax tree is in the stage's key)
STAGE_CODE: dict[str, tuple[str, ...]] = {
    "corpus": ("ccexp.data.corpus", "ccexp.data.remote", "ccexp.data.store", "ccexp.stages:Stages.corpus"),
    "embed": ("ccexp.embedding.sentence", "ccexp.embedding.gradient", "ccexp.embedding.shards",
              "ccexp.stages:Stages.embed", "ccexp.stages:Stages._embedder_inputs"),
    "cluster": ("ccexp.clustering.kmeans", "ccexp.clustering.hierarchical", "ccexp.clustering.two_level",
                "ccexp.clustering.labels", "ccexp.clustering.report", "ccexp.stages:Stages.cluster"),
    "dedup": ("ccexp.clustering.dedup", "ccexp.stages:Stages.dedup"),
    "model": ("ccexp.model_source", "ccexp.stages:Stages.model"),
    "tokenize": ("ccexp.data.tokenize", "ccexp.stages:Stages.tokenize", "ccexp.stages:Stages._tokenizer"),
    "reference": ("ccexp.training.runner", "ccexp.training.module", "ccexp.training.data", "ccexp.training.models",
                  "ccexp.data.packing", "ccexp.sampling.random", "ccexp.sampling.base", "ccexp.sampling.kernels",
                  "ccexp.evaluation.perplexity", "ccexp.training.reference"),
    "proxy": ("ccexp.training.runner", "ccexp.training.module", "ccexp.training.data", "ccexp.training.models",
              "ccexp.data.packing", "ccexp.sampling.dynamic", "ccexp.sampling.base", "ccexp.sampling.kernels",
              "ccexp.sampling.uniform", "ccexp.sampling.clip", "ccexp.training.reference"),
}
# the libraries whose numbers reach each stage's output (their versions are in its key)
STAGE_LIBRARIES: dict[str, tuple[str, ...]] = {
    "corpus": ("pyarrow", "datasets"), "embed": ("torch", "transformers", "sentence-transformers"),
    "cluster": ("faiss-cpu", "faiss-gpu-cu12", "numpy"), "dedup": ("faiss-cpu", "faiss-gpu-cu12", "numpy"),
    "model": ("gguf", "transformers", "torch"), "tokenize": ("tokenizers", "transformers"),
    "reference": ("torch", "lightning", "transformers"), "proxy": ("torch", "lightning", "transformers"),
}


@functools.cache
def code_digest(stage: str) -> str:
    """16 hex digits over the syntax trees (without docstrings) of [`STAGE_CODE`][ccexp.stage_keys.STAGE_CODE] ``[stage]``."""
    h = hashlib.sha256()
    for entry in STAGE_CODE[stage]:
        module, _, name = entry.partition(":")
        tree: ast.AST = ast.parse(Path(util.find_spec(module).origin).read_text())
        for part in name.split(".") if name else []:  # a class, then a method of it
            tree = next(n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part)
        for node in ast.walk(tree):  # docstrings say what the code does; they do not change its output
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                    isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        h.update(entry.encode() + ast.dump(tree).encode())
    return h.hexdigest()[:16]


@functools.cache
def library_versions(stage: str) -> dict[str, str]:
    """The installed versions of [`STAGE_LIBRARIES`][ccexp.stage_keys.STAGE_LIBRARIES] ``[stage]`` (those installed)."""
    out = {}
    for name in STAGE_LIBRARIES.get(stage, ()):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def stage_fingerprint(stage: str, config: Any, inputs: dict[str, Any]) -> str:
    """The fingerprint of ``stage`` with these settings and inputs, its code and its libraries."""
    return fingerprint(stage, code_digest(stage), config, {**inputs, "libraries": library_versions(stage)})


def content_digest(path: str | Path, cache: Path | None = None, *, record: bool = True) -> str:
    """16 hex digits over a file's bytes, or a folder's files (relative paths and bytes, in order). With
    ``cache`` (a JSON file), a file whose size and modification time are unchanged is not read again, so
    a multi-gigabyte model folder is hashed once per change, not once per run; ``record=False`` reads the
    cache but leaves it as it is (the other ranks of a launch)."""
    path = Path(path)
    if not path.exists():
        return f"missing:{path}"
    saved: dict[str, str] = {}
    if cache is not None and cache.is_file():
        try:
            saved = json.loads(cache.read_text())
        except (OSError, ValueError):
            saved = {}
    fresh: dict[str, str] = {}

    def digest(f: Path) -> str:
        st = f.stat()
        key = f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        fresh[key] = saved.get(key) or file_digest(f)
        return fresh[key]

    if path.is_file():
        out = digest(path)
    else:
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(path).as_posix()}:{digest(f)}\n".encode())
        out = h.hexdigest()[:16]
    if cache is not None and record and fresh.keys() - saved.keys():
        from ccexp.artifacts import write_text_atomic

        cache.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cache, json.dumps({**saved, **fresh}))
    return out


def object_digest(objects: list[dict]) -> str:
    """``objects:`` and 16 hex digits over what an object store says identifies each object of a remote corpus
    ([`ccexp.data.remote.RemoteSource.identity`][ccexp.data.remote.RemoteSource.identity]: URL, size, ETag / version id / generation): a changed
    object changes it, without its bytes being read."""
    text = json.dumps(sorted(objects, key=lambda o: o["name"]), sort_keys=True, default=str)
    return "objects:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _settings(node: DictConfig, drop: tuple[str, ...]) -> dict:
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in drop}


def corpus_key(data: DictConfig, source_digest: str) -> tuple[dict, dict]:
    """(settings, inputs) of the corpus stage: ``data.*`` but its name, path and sources; the source's bytes (for
    a URL, [`object_digest`][ccexp.stage_keys.object_digest] of its objects; for ``data.sources``, each source's name and digest, in order:
    their weights only steer the sampler). ``data.max_documents`` over several sources subsamples the corpus
    as one (before it subsampled each source: such a cached corpus is not reused)."""
    over = {"max_documents_of": "corpus"} if data.get("sources") and data.get("max_documents") else {}
    return _settings(data, ("name", "path", "sources")), {"file": source_digest, **over}


def embed_key(embedder: DictConfig, corpus_content: str, model: str | None) -> tuple[dict, dict]:
    """(settings, inputs) of the embed stage: ``embedder.*`` but what does not change the vectors (``dtype``
    as resolved on this machine); the corpus content and ``model`` (the digest of the embedding model folder, or the run's model stage)."""
    settings = _settings(embedder, ("name", "device", "batch_size"))
    if "dtype" in settings:  # auto: what this machine runs (bfloat16 or float32 give different vectors)
        from ccexp.embedding.sentence import resolve_dtype

        settings["dtype"] = resolve_dtype(settings["dtype"], embedder.get("device", "auto"))
    return settings, {"corpus": corpus_content, "model": model}


def cluster_key(clusterer: DictConfig, embed: str, corpus_content: str, labels: str | None) -> tuple[dict, dict]:
    """(settings, inputs) of the cluster stage: ``clusterer.*`` but its name and what only paces it; the
    embedding, the corpus content (the split it trains on) and the label values its report reads."""
    return (_settings(clusterer, ("name", "verbose", "assign_batch")),
            {"embed": embed, "corpus": corpus_content, "labels": labels})


def dedup_key(dedup: DictConfig, cluster: str, labels: str | None) -> tuple[dict, dict]:
    """(settings, inputs) of the dedup stage: its threshold, ``keep``, seed and examples; the clustering and
    the label values its report reads."""
    return ({"threshold": float(dedup.threshold), "keep": dedup.keep, "seed": int(dedup.seed),
             "examples": int(dedup.examples)}, {"cluster": cluster, "labels": labels})


def tokenize_key(tokenizer: DictConfig, corpus_content: str, model: str | None,
                 source_digest: str | None) -> tuple[dict, dict]:
    """(settings, inputs) of the tokenize stage: the tokenizer's kind, vocabulary size (a trained BPE) and
    separator; the corpus content, the model stage and the pretrained tokenizer folder's bytes."""
    settings = {"kind": tokenizer.kind, "separator": tokenizer.separator}
    if tokenizer.kind == "bpe":
        settings["vocab_size"] = int(tokenizer.vocab_size)
    inputs = {"corpus": corpus_content, "tokenizer": source_digest}
    if model is not None:
        inputs["model"] = model
    return settings, inputs


def reference_key(cfg: DictConfig, upstream: dict[str, str], weights: str | None, split: str) -> tuple[dict, dict]:
    """(settings, inputs) of DoReMi's reference stage: the settings of its training run (the model, the
    trainer's numerics, the ``train.*`` that shape its stream and optimiser, its seeds, steps and scored
    documents, ``eval.max_tokens``); the upstream stages' fingerprints (``upstream``), the model's weights
    and the digest of the training split it trains on (documents and their clusters)."""
    s, t = cfg.sampler, cfg.train
    trainer = _settings(cfg.trainer, ("devices", "num_nodes", "strategy", "enable_progress_bar", "threads", "fsdp",
                                      "name"))
    settings = {"steps": int(s.reference_steps), "documents": int(s.reference_documents), "init_seed": int(t.init_seed),
                "sampler_seed": int(s.seed), "level": s.level, "model": OmegaConf.to_container(cfg.model, resolve=True),
                "trainer": trainer, "eval": {"max_tokens": int(cfg.eval.max_tokens)},
                "train": {k: t[k] for k in ("tokens_per_step", "seq_len", "lr", "weight_decay", "warmup_steps",
                                             "max_doc_tokens", "document_mask", "micro_batch_size", "on_nonfinite")}}
    return settings, {**upstream, "weights": weights, "train_split": split}


def proxy_key(proxy: DictConfig, steps: int, upstream: dict[str, str], weights: str | None, split: str,
              reference_losses: str) -> tuple[dict, dict]:
    """(settings, inputs) of DoReMi's proxy run: its training run's settings as the reference run's
    ([`reference_key`][ccexp.stage_keys.reference_key] of the proxy's config), its own ``steps`` and sampler settings; the reference
    losses it is driven by (``reference_losses``: their digest) besides the reference run's inputs."""
    settings, inputs = reference_key(proxy, upstream, weights, split)
    return ({**settings, "proxy_steps": int(steps), "sampler": OmegaConf.to_container(proxy.sampler, resolve=True)},
            {**inputs, "reference_losses": reference_losses})
