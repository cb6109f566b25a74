"""Fully sharded data parallel for large models (torch's FSDP through Lightning, configured from ``trainer.fsdp``),
on GPUs and on the CPU, and the process's place in a launch.

* **Auto-wrap by decoder layer**: each transformer block becomes its own FSDP unit (the classes the
  Hugging Face model names in ``_no_split_modules``: ``LlamaDecoderLayer``, ``MistralDecoderLayer``,
  ...), so only one block's full parameters exist at a time; activation checkpointing uses the same
  classes.
* **Weights read once** (``trainer.fsdp.load_weights=rank0``): global rank 0 reads the checkpoint; the other
  ranks build the model with its *parameters* on the meta device and its *buffers* computed for real
  ([`empty_model`][ccexp.training.distributed.empty_model]: a rotary embedding's ``inv_freq`` is in no state dict, so
  it must be right by construction, never copied from rank 0 by luck); rank 0's parameter values are then
  broadcast (FSDP's ``sync_module_states`` on GPUs, [`FSDPStrategy`][ccexp.training.distributed.FSDPStrategy]'s own
  broadcast on the CPU, where torch's refuses CPU tensors).
* **On the CPU** (``trainer=fsdp trainer.accelerator=cpu``, gloo): FSDP runs with ``device_id=cpu``, for trying a
  recipe on a laptop and for CI; Lightning's own FSDP strategy refuses a CPU accelerator by exact type.
* **Sharded checkpoints** (``state_dict_type=sharded``): every rank writes its own shard into a temporary folder;
  rank 0 renames it into place once every shard and ``meta.pt`` are written, so ``last.ckpt`` is whole or absent,
  never half overwritten ([`FSDPStrategy.save_checkpoint`][ccexp.training.distributed.FSDPStrategy.save_checkpoint]).
* **Evaluation stays sharded**: held-out scoring runs on every rank with the wrapped model
  ([`ccexp.evaluation.perplexity.sharded_document_nll`][ccexp.evaluation.perplexity.sharded_document_nll]); a whole
  copy is only ever written to disk, streamed from the final checkpoint ([`ccexp.training.export`][ccexp.training.export]).

Why FSDP1 (``FullyShardedDataParallel`` through Lightning's ``FSDPStrategy``) and not FSDP2 (``fully_shard``,
Lightning's ``ModelParallelStrategy``): Lightning 2.6's FSDP strategy wraps any ``LightningModule`` by policy and
keeps its precision plugin, gradient clipping and sharded checkpoint format (``meta.pt`` + torch.distributed.checkpoint
shards), which ccexp's resume, export and GPU check already read; ``ModelParallelStrategy`` asks the module to shard
itself in ``configure_model`` and is marked experimental. Buffers are correct by construction here, so nothing relies
on FSDP1's broadcast of buffers, and a move to FSDP2 changes the wrapping, not the model build.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy
from omegaconf import DictConfig

from ccexp.artifacts import replace_folder
from ccexp.errors import CcexpError

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
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise CcexpError(f"trainer.fsdp.auto_wrap=decoder_layer: {type(model).__name__} names no decoder layer class "
                         "(_no_split_modules); set trainer.fsdp.auto_wrap=null to shard it as one unit")
    return classes


def empty_model(build):
    """``build()`` (a function that constructs a ``torch.nn.Module``) with every *parameter* on the meta device (no
    memory, no initialisation) and every *buffer* computed on the CPU as the module's constructor computes it:
    accelerate's ``init_empty_weights(include_buffers=False)``. A non-persistent buffer (a rotary embedding's
    ``inv_freq``, GPT-2's causal mask) is in no state dict, so loading weights cannot fix it afterwards.

    Raises:
        CcexpError: if a buffer still ends on the meta device (a constructor that derives a buffer from a parameter).
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):  # transformers skips tying parameters it built on meta (GPT-2's lm_head)
        model.tie_weights()
    meta = [name for name, b in model.named_buffers() if b is not None and b.is_meta]
    if meta:
        raise CcexpError(f"{type(model).__name__}: buffer(s) {', '.join(meta[:4])} are left on the meta device by its "
                         "constructor; load its weights on every rank (trainer.fsdp.load_weights=every_rank)")
    return model


class ParameterMaterialiser:
    """FSDP's ``param_init_fn`` on ranks whose parameter values arrive from rank 0: give a module's own meta-device
    parameters (not its children's) uninitialised storage on ``device`` (this rank's GPU, else the CPU); its buffers
    keep their values and move there. Unlike ``module.to_empty()``, which also empties every buffer, a buffer computed
    at construction (a rotary ``inv_freq``) is never replaced by uninitialised memory; and a parameter shared by two
    modules (GPT-2's tied ``wte`` and ``lm_head``) stays one parameter, whichever module is materialised first (the
    object remembers what it made)."""

    def __init__(self, device: torch.device | None = None):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = device
        self._made: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}  # id(meta) -> (meta, materialised)

    def __call__(self, module: torch.nn.Module) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                made = self._made.get(id(param))
                if made is None:
                    made = self._made[id(param)] = (param, torch.nn.Parameter(
                        torch.empty_like(param, device=self.device), requires_grad=param.requires_grad))
                module.register_parameter(name, made[1])
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.device != self.device:
                module._buffers[name] = buf.to(self.device)


def materialise_parameters(model: torch.nn.Module, device: torch.device | None = None) -> None:
    """[`ParameterMaterialiser`][ccexp.training.distributed.ParameterMaterialiser] over every module of ``model``."""
    make = ParameterMaterialiser(device)
    for module in model.modules():
        make(module)


def broadcast_module_states(module: torch.nn.Module, src: int = 0) -> int:
    """Materialise ``module``'s meta parameters and copy every parameter's and buffer's values from rank ``src``
    (``torch.distributed.broadcast``, one tensor at a time: any backend, gloo on the CPU included). Every rank calls
    it. Returns the number of tensors broadcast."""
    import torch.distributed as dist

    materialise_parameters(module, torch.device("cpu"))
    n = 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *(b for b in module.buffers() if b is not None)]:
            dist.broadcast(tensor.data, src=src)
            n += 1
    return n


class FSDPStrategy(LightningFSDPStrategy):
    """Lightning's ``FSDPStrategy`` on any device, with sharded checkpoints written whole or not at all.

    * On the CPU: FSDP gets ``device_id=cpu`` (Lightning passes a CUDA index), the process group is gloo, a full
      state dict is gathered without ``offload_to_cpu`` (with two CPU ranks that path segfaults in torch,
      pytorch/pytorch#188989), and ``load_weights=rank0`` broadcasts rank 0's values itself
      ([`broadcast_module_states`][ccexp.training.distributed.broadcast_module_states]: torch's ``sync_module_states``
      refuses CPU tensors, ``_init_utils._check_module_states_for_sync_module_states``).
    * On GPUs, ``load_weights=rank0`` is FSDP's ``sync_module_states`` with
      [`ParameterMaterialiser`][ccexp.training.distributed.ParameterMaterialiser] as ``param_init_fn``.

    Args:
        rank0_weights: only rank 0 holds the pretrained values; the others built the model with
            [`empty_model`][ccexp.training.distributed.empty_model].
        **kwargs: Lightning's ``FSDPStrategy`` arguments.
    """

    strategy_name = "fsdp"

    def __init__(self, *, rank0_weights: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.rank0_weights = bool(rank0_weights)

    @property
    def on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``model`` in ``FullyShardedDataParallel`` on this rank's device (Lightning's ``_setup_model`` with
        ``device_id`` a device, the CPU included, and the weights of rank 0 on every rank)."""
        from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        kwargs = dict(self.kwargs)
        if self.rank0_weights and self.on_cpu:
            n = broadcast_module_states(model)
            log.info("fsdp: rank 0's weights broadcast to every rank (%d tensors, gloo)", n)
        elif self.rank0_weights:
            kwargs.update(sync_module_states=True, param_init_fn=ParameterMaterialiser())
        model = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                         mixed_precision=self.mixed_precision_config,
                                         sharding_strategy=self.sharding_strategy, device_id=self.root_device, **kwargs)
        _move_torchmetrics_to_device(model, self.root_device)
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    def _full_state_dict_context(self):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.api import FullOptimStateDictConfig

        return FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                    FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                                    FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))

    def lightning_module_state_dict(self) -> dict:
        if self._state_dict_type != "full" or not self.on_cpu:
            return super().lightning_module_state_dict()
        with self._full_state_dict_context():
            return self.model.state_dict()

    def optimizer_state(self, optimizer) -> dict:
        if self._state_dict_type != "full" or not self.on_cpu:
            return super().optimizer_state(optimizer)
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        with self._full_state_dict_context():
            state = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Lightning's save, and for a sharded checkpoint: every rank writes into ``.<name>.tmp-<id>`` beside
        ``filepath``; once torch.distributed.checkpoint has every shard and ``.metadata`` and rank 0 has written
        ``meta.pt``, rank 0 moves the previous checkpoint aside, renames the new one into place and deletes the old
        one. A kill while shards are written leaves the previous checkpoint whole and a temporary folder that
        [`ccexp.launch.resume`][ccexp.launch.resume] never reads."""
        if self._state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        final = Path(self.broadcast(str(filepath)))
        tag = self.broadcast(uuid.uuid4().hex[:12])
        tmp = final.with_name(f".{final.name}.tmp-{tag}")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            self.barrier("ccexp-sharded-checkpoint-written")
            if self.global_rank == 0:
                replace_folder(tmp, final)
        except BaseException:
            if self.global_rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.barrier("ccexp-sharded-checkpoint-renamed")


def fsdp_strategy(trainer: DictConfig, model: torch.nn.Module) -> FSDPStrategy:
    """ccexp's [`FSDPStrategy`][ccexp.training.distributed.FSDPStrategy] from ``trainer.fsdp``: auto-wrap and activation
    checkpointing by the model's decoder layer class, the sharding strategy, sharded or full checkpoints, and with
    ``load_weights=rank0`` rank 0's weights on every rank."""
    f = trainer.fsdp
    classes = layer_classes(model) if f.auto_wrap == "decoder_layer" else None
    rank0 = f.load_weights == "rank0"
    log.info("fsdp: %s on %s, wrapping %s, activation checkpointing %s, %s checkpoints, weights %s", f.sharding_strategy,
             "the CPU (gloo)" if str(trainer.accelerator) == "cpu" else "GPUs",
             ", ".join(sorted(c.__name__ for c in classes)) if classes else "the whole model",
             "on" if f.activation_checkpointing and classes else "off", f.state_dict_type,
             "read on rank 0 and broadcast" if rank0 else "read on every rank")
    return FSDPStrategy(auto_wrap_policy=classes, activation_checkpointing_policy=classes if f.activation_checkpointing
                        else None, sharding_strategy=f.sharding_strategy, state_dict_type=f.state_dict_type,
                        cpu_offload=bool(f.cpu_offload), use_orig_params=True, limit_all_gathers=True,
                        rank0_weights=rank0)
