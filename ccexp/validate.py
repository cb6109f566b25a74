"""Up-front checks of a composed config: every value a user can get wrong is checked here, before
any stage runs, so a bad option costs seconds, not an embedding pass. Each failure is one
:class:`CcexpError` line naming the key and the fix."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ccexp import config as schemas
from ccexp.errors import CcexpError

# groups whose keys are checked against their schema (the `_target_` groups are checked against
# their constructors by ccexp.build.check_buildable)
_SCHEMAS = {"train": schemas.TrainConfig, "paths": schemas.PathsConfig, "data": schemas.DataConfig,
            "trainer": schemas.TrainerConfig, "logger": schemas.LoggerConfig, "eval": schemas.EvalConfig}
_PRECISIONS = {"64", "64-true", "32", "32-true", "16", "16-mixed", "bf16", "bf16-mixed", "16-true", "bf16-true",
               "transformer-engine", "transformer-engine-float16"}


def _unknown_keys(node: DictConfig, schema, prefix: str) -> None:
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields:
            raise CcexpError(f"{prefix}.{key} is not a setting of {prefix}; known: {', '.join(sorted(fields))}")


def _at_least(cfg: DictConfig, key: str, low: float, *, optional: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None and optional:
        return
    if value is None or value < low:
        raise CcexpError(f"{key}={value} is out of range; it must be >= {low}")


def check_config(cfg: DictConfig) -> None:
    """Raise :class:`CcexpError` for the first invalid setting in ``cfg``."""
    root = {f.name for f in dataclasses.fields(schemas.RootConfig)}
    for key in cfg.keys():
        if key not in root:
            raise CcexpError(f"{key} is not a ccexp setting; top-level settings are {', '.join(sorted(root))}")
    for group, schema in _SCHEMAS.items():
        _unknown_keys(cfg[group], schema, group)
    if not 0 <= cfg.seed < 2**32:
        raise CcexpError(f"seed={cfg.seed} is out of range; use an integer in [0, 2**32)")
    for key, low in [("train.steps", 1), ("train.tokens_per_step", 1), ("train.micro_batch_size", 1),
                     ("train.seq_len", 2), ("train.warmup_steps", 0), ("train.log_every_n_steps", 1),
                     ("eval.max_tokens", 1), ("eval.batch_size", 1), ("eval.min_cluster_docs", 1),
                     ("eval.max_cluster_metrics", 0), ("clusterer.niter", 1),
                     ("clusterer.max_points_per_centroid", 1), ("embedder.batch_size", 1),
                     ("embedder.max_seq_length", 1), ("embedder.shard_size", 1), ("trainer.num_nodes", 1),
                     ("eval.curve_documents", 1)]:
        _at_least(cfg, key, low)
    for key in ("data.max_documents", "train.checkpoint_every_n_steps", "trainer.threads", "clusterer.k",
                "train.max_doc_tokens", "eval.every_n_steps"):
        _at_least(cfg, key, 1, optional=True)
    if not cfg.train.lr > 0:
        raise CcexpError(f"train.lr={cfg.train.lr} must be > 0")
    if not 0.0 < cfg.data.heldout_fraction < 1.0:
        raise CcexpError(f"data.heldout_fraction={cfg.data.heldout_fraction} must be in (0, 1)")
    _check_trainer(cfg)
    _check_token_budget(cfg)
    _check_model(cfg)
    _check_paths(cfg)


def _check_token_budget(cfg: DictConfig) -> None:
    """The step's tokens split into rows and micro-batches on every rank; the derived accumulation was
    not overridden by hand."""
    t = cfg.train
    world = schemas.world_size(cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.accelerator)
    derived = schemas.grad_accumulation(t.tokens_per_step, t.seq_len, t.micro_batch_size, world)
    node = OmegaConf.to_container(t, resolve=False)["grad_accumulation"]
    if node != schemas.GRAD_ACCUMULATION and int(node) != derived:
        raise CcexpError(f"train.grad_accumulation={node} but it is derived: tokens_per_step / (seq_len x "
                         f"micro_batch_size x world size) = {derived}; set train.tokens_per_step or "
                         "train.micro_batch_size instead")


def _check_trainer(cfg: DictConfig) -> None:
    t = cfg.trainer
    if str(t.precision) not in _PRECISIONS:
        raise CcexpError(f"trainer.precision={t.precision!r} is not an option; use one of {', '.join(sorted(_PRECISIONS))}")
    devices = t.devices
    if not (devices == "auto" or (isinstance(devices, int) and (devices >= 1 or devices == -1))
            or OmegaConf.is_list(devices)):
        raise CcexpError(f"trainer.devices={devices!r} is not valid; use a count >= 1, -1 (all), 'auto' or a list of ids")
    if t.accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CcexpError(f"trainer={t.name} needs a CUDA GPU and none is visible; use trainer=cpu")


def _check_model(cfg: DictConfig) -> None:
    m = cfg.model
    if m.tokenizer.kind not in ("bpe", "pretrained"):
        raise CcexpError(f"model.tokenizer.kind={m.tokenizer.kind!r} is not an option; use bpe or pretrained")
    if m.tokenizer.kind == "bpe" and m.tokenizer.vocab_size < 300:
        raise CcexpError(f"model.tokenizer.vocab_size={m.tokenizer.vocab_size} is too small for a byte-level BPE "
                         "(>= 300)")
    if "n_head" in m and (m.n_head < 1 or m.n_embd % m.n_head):
        raise CcexpError(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    if "n_positions" in m and m.n_positions < max(cfg.train.seq_len, cfg.eval.max_tokens + 1):
        raise CcexpError(f"model.n_positions={m.n_positions} is shorter than train.seq_len / eval.max_tokens+1 "
                         f"({max(cfg.train.seq_len, cfg.eval.max_tokens + 1)}); raise model.n_positions")
    if "pretrained" in m:
        require_local_model(m.pretrained, "model.pretrained")


def require_local_model(name: str, key: str) -> None:
    """A local folder, or a model id already in the local Hugging Face cache; else one-line error."""
    path = Path(name).expanduser()
    looks_like_path = name.startswith(("/", ".", "~")) or path.exists()
    if looks_like_path:
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise CcexpError(f"{key}={name!r} is not a model folder (no config.json there); give a folder saved "
                             "with save_pretrained, or a model id in the local Hugging Face cache")
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise CcexpError(f"{key}={name!r} is not in the local Hugging Face cache and ccexp never downloads at run "
                         f"time; fetch it first (`huggingface-cli download {name}`) or give a local folder")


def _check_paths(cfg: DictConfig) -> None:
    out = Path(cfg.paths.outputs).expanduser()
    if out.exists() and not out.is_dir():
        raise CcexpError(f"paths.outputs={str(out)!r} is a file; give a folder for ccexp's outputs")


def check_sampler_options(cfg: DictConfig) -> None:
    """Build the sampler on a stand-in clustering (K clusters of one document) to check its options and
    that it can lay out a step's rows."""
    from ccexp.training import runner

    k = cluster_count(cfg)
    labels = np.arange(k, dtype=np.int32)
    sampler = runner.make_sampler(cfg, labels, np.ones(k, dtype=np.int64), np.zeros(k, dtype=np.float32))
    sampler.row_lanes(cfg.train.tokens_per_step // cfg.train.seq_len)


def cluster_count(cfg: DictConfig) -> int:
    """K at the level the sampler balances: ``clusterer.k``, or ``clusterer.levels[sampler.level]``.

    Raises:
        CcexpError: if ``sampler.level`` is not a level of the clusterer.
    """
    levels = list(cfg.clusterer.levels) if "levels" in cfg.clusterer else [cfg.clusterer.k]
    level = int(cfg.sampler.level)
    if not 0 <= level < len(levels):
        raise CcexpError(f"sampler.level={level} but clusterer={cfg.clusterer.name} has {len(levels)} level(s) "
                         f"{levels}; use a level in 0..{len(levels) - 1}")
    return int(levels[level])
