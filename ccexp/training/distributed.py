"""Fully sharded data parallel for large models (Lightning's ``FSDPStrategy`` configured from
``trainer.fsdp``) and the process's place in a launch.

* **Auto-wrap by decoder layer**: each transformer block becomes its own FSDP unit — the classes the
  Hugging Face model names in ``_no_split_modules`` (``LlamaDecoderLayer``, ``MistralDecoderLayer``,
  ...) — so only one block's full parameters exist at a time; activation checkpointing uses the same
  classes.
* **Weights read once**: with ``trainer.fsdp.load_weights=rank0`` global rank 0 loads the
  checkpoint, the other ranks build the model on the meta device (no host memory), and FSDP
  materialises their shards and broadcasts rank 0's values (``sync_module_states``) — not one full
  copy per GPU in host RAM.
* **Sharded checkpoints** (``state_dict_type=sharded``): every rank writes its own shard.
* **Evaluation after fit** on a sharded model: [`gather_full_model`][ccexp.training.distributed.gather_full_model] collects a full state dict
  on rank 0 (CPU, one copy) and rebuilds an unsharded model there for held-out scoring and lm-eval.

Not yet run on a GPU (the CI machine has none): ``benches/gpu_check.py`` (docs/benchmarks.md, "On a
GPU") runs ``trainer=fsdp`` on one device at ~1B parameters, sharded checkpoint and resume included,
where a GPU exists.
"""
from __future__ import annotations

import logging
import os

import torch
from omegaconf import DictConfig

log = logging.getLogger("ccexp")


def global_rank(devices_per_node: int = 1) -> int:
    """This process's global rank from the launcher's environment (torchrun ``RANK``, Slurm
    ``SLURM_PROCID``, Lightning's own launcher ``NODE_RANK · devices_per_node + LOCAL_RANK``); 0
    outside a launch (and in the process that will start Lightning's other ranks)."""
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    if "LOCAL_RANK" in os.environ:
        return int(os.environ.get("NODE_RANK", "0")) * devices_per_node + int(os.environ["LOCAL_RANK"])
    return 0


def uses_fsdp(trainer: DictConfig) -> bool:
    """True when the ``trainer`` option's strategy is FSDP."""
    return str(trainer.strategy).startswith("fsdp")


def layer_classes(model: torch.nn.Module) -> set[type]:
    """The model's transformer block classes: the modules named in its ``_no_split_modules``.

    Raises:
        CcexpError: if the model names none (wrap it as one unit with ``trainer.fsdp.auto_wrap=null``).
    """
    from ccexp.errors import CcexpError

    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise CcexpError(f"trainer.fsdp.auto_wrap=decoder_layer: {type(model).__name__} names no decoder layer class "
                         "(_no_split_modules); set trainer.fsdp.auto_wrap=null to shard it as one unit")
    return classes


def fsdp_strategy(trainer: DictConfig, model: torch.nn.Module):
    """Lightning's ``FSDPStrategy`` from ``trainer.fsdp``: auto-wrap and activation checkpointing by the
    model's decoder layer class, the sharding strategy, sharded checkpoints, and — when ``load_weights``
    is ``rank0`` — ``sync_module_states`` with meta-device materialisation on the other ranks."""
    from lightning.pytorch.strategies import FSDPStrategy

    f = trainer.fsdp
    classes = layer_classes(model) if f.auto_wrap == "decoder_layer" else None
    kwargs = {}
    if f.load_weights == "rank0":
        kwargs.update(sync_module_states=True, param_init_fn=_materialise)
    log.info("fsdp: %s, wrapping %s, activation checkpointing %s, %s checkpoints, weights %s",
             f.sharding_strategy, ", ".join(sorted(c.__name__ for c in classes)) if classes else "the whole model",
             "on" if f.activation_checkpointing and classes else "off", f.state_dict_type,
             "read on rank 0 and broadcast" if f.load_weights == "rank0" else "read on every rank")
    return FSDPStrategy(auto_wrap_policy=classes, activation_checkpointing_policy=classes if f.activation_checkpointing
                        else None, sharding_strategy=f.sharding_strategy, state_dict_type=f.state_dict_type,
                        cpu_offload=bool(f.cpu_offload), use_orig_params=True, limit_all_gathers=True, **kwargs)


def _materialise(module: torch.nn.Module) -> None:
    """FSDP ``param_init_fn``: allocate a meta-device module's own tensors on this rank's GPU (values
    arrive from rank 0 through ``sync_module_states``)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    module.to_empty(device=device, recurse=False)


def gather_full_model(trainer, module) -> torch.nn.Module | None:
    """Collect the trained, sharded model's full state dict on rank 0 (on the CPU, one copy) and load it
    into a fresh unsharded model there, on rank 0's device. Every rank must call it; ranks other
    than 0 get None."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    wrapped = trainer.strategy.model
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        state = wrapped.state_dict()
    if not trainer.is_global_zero:
        return None
    inner = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    config = module.model.config
    with torch.device("meta"):
        full = type(module.model)(config)
    full.load_state_dict(inner, assign=True, strict=False)
    full.tie_weights()
    log.info("fsdp: gathered the full model on rank 0 for evaluation (%.1fB parameters)",
             sum(p.numel() for p in full.parameters()) / 1e9)
    return full.to(trainer.strategy.root_device).eval()
