"""The trained model as a Hugging Face folder (``config.json``, ``model-0000i-of-0000n.safetensors`` with their
index, the tokenizer), for lm-eval, ``transformers``' ``from_pretrained`` and any other trainer or server.

A model that was trained sharded (FSDP) is never gathered in memory: its tensors are read one group at a time from
the run's final checkpoint, a torch.distributed.checkpoint folder (``trainer.fsdp.state_dict_type=sharded``, read
with ``no_dist=True`` on one process) or a full ``.ckpt`` file (memory-mapped), and written shard by shard, so the
peak is one safetensors shard (``SHARD_BYTES``), not the model. The folder is written beside its final name and
renamed into place when whole ([`ccexp.artifacts.folder_written_whole`][ccexp.artifacts.folder_written_whole]).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from ccexp.artifacts import folder_written_whole
from ccexp.errors import CcexpError
from ccexp.training.distributed import empty_model

log = logging.getLogger("ccexp")

SHARD_BYTES = 2 * 1024**3  # bytes of tensors per safetensors file (transformers' default max_shard_size is 5 GB)


def weight_names(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors ``save_pretrained`` would write for ``model``'s architecture: name -> (shape, dtype) of every
    parameter once (a tied ``lm_head.weight`` is left to ``tie_weights`` on load) and every persistent buffer."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        out[name] = (tuple(p.shape), p.dtype)
    persistent = set(model.state_dict().keys())
    for name, b in model.named_buffers(remove_duplicate=True):
        if b is not None and name in persistent:
            out[name] = (tuple(b.shape), b.dtype)
    return out


def checkpoint_reader(checkpoint: Path, prefix: str = "model."):
    """A function ``read(names) -> {name: tensor}`` over the model tensors of a Lightning checkpoint written by
    ccexp's FSDP strategy: a sharded folder (torch.distributed.checkpoint, its tensors under ``state_dict`` key
    ``model``) or a full ``.ckpt`` file (``state_dict``); ``prefix``: the LightningModule's attribute holding the
    causal LM (``CausalLMModule.model``).

    Raises:
        CcexpError: if ``checkpoint`` is neither.
    """
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir() and (checkpoint / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
        stored = metadata.state_dict_metadata

        def read_sharded(names: list[str]) -> dict[str, torch.Tensor]:
            want = {}
            for name in names:
                meta = stored.get(f"model.{prefix}{name}")
                if meta is None:
                    raise CcexpError(f"{checkpoint}: no tensor {prefix}{name} in this checkpoint; it was saved by "
                                     "another model")
                want[f"{prefix}{name}"] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            state = {"model": want}
            dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
            return {name: state["model"][f"{prefix}{name}"] for name in names}

        return read_sharded
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["state_dict"]

        def read_full(names: list[str]) -> dict[str, torch.Tensor]:
            missing = [n for n in names if f"{prefix}{n}" not in state]
            if missing:
                raise CcexpError(f"{checkpoint}: no tensor {prefix}{missing[0]} in this checkpoint; it was saved by "
                                 "another model")
            return {n: state[f"{prefix}{n}"] for n in names}

        return read_full
    raise CcexpError(f"{checkpoint} is not a checkpoint ccexp wrote (a sharded folder with .metadata, or a .ckpt file)")


def export_checkpoint(checkpoint: Path, config, out_dir: Path, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write the causal LM of ``checkpoint`` ([`checkpoint_reader`][ccexp.training.export.checkpoint_reader]) with
    ``config`` (a ``transformers`` config) as a Hugging Face folder at ``out_dir``, streamed: at most
    [`SHARD_BYTES`][ccexp.training.export.SHARD_BYTES] of tensors in memory at once. ``dtype``: cast floating
    tensors (None keeps the checkpoint's). Returns ``out_dir``.

    Raises:
        CcexpError: if the checkpoint lacks a tensor of the architecture.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    skeleton = empty_model(lambda: AutoModelForCausalLM.from_config(config))
    names = weight_names(skeleton)
    read = checkpoint_reader(checkpoint)
    with folder_written_whole(Path(out_dir)) as tmp:
        groups, group, size = [], [], 0
        for name, (shape, dt) in names.items():
            nbytes = int(torch.Size(shape).numel()) * (dtype or dt).itemsize
            if group and size + nbytes > SHARD_BYTES:
                groups.append(group)
                group, size = [], 0
            group.append(name)
            size += nbytes
        groups.append(group)
        weight_map, total = {}, 0
        for i, group in enumerate(groups, start=1):
            file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            tensors = read(group)
            if dtype is not None:
                tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
            tensors = {k: v.contiguous() for k, v in tensors.items()}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            total += sum(v.numel() * v.element_size() for v in tensors.values())
            weight_map.update({k: file for k in group})
            del tensors
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    log.info("export: %s as a Hugging Face folder %s (%d file(s), %s), streamed from the checkpoint in %.1f s",
             type(skeleton).__name__, out_dir, len(groups), f"{total / 1e9:.2f} GB" if total >= 1e8 else
             f"{total / 1e6:.2f} MB", time.perf_counter() - t0)
    return out_dir


def export_model(model: torch.nn.Module, out_dir: Path, tokenizer=None) -> Path:
    """Write an unsharded ``model`` (a ``transformers`` causal LM) as a Hugging Face folder at ``out_dir`` with
    ``save_pretrained``, renamed into place when whole. Returns ``out_dir``."""
    with folder_written_whole(Path(out_dir)) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    log.info("export: %s as a Hugging Face folder %s", type(model).__name__, out_dir)
    return out_dir


def load_exported(folder: Path, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The causal LM of an exported folder on ``device`` in ``dtype`` (None: as saved), in eval mode."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype} if dtype is not None else {}
    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **kwargs).to(device).eval()
