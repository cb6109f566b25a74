"""The one helper through which ccexp creates configured objects (around ``hydra.utils.instantiate``)."""
from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ccexp.errors import CcexpError

# keys that describe an option but are not constructor arguments: its name, the tokenizer a model
# option carries, the level a sampler balances at, the held-out split and shard size a corpus option
# carries (the corpus stage uses them, and the split's stratification), the CPU threads and FSDP settings a
# trainer option carries (the runner builds the strategy), and the architecture numbers a model option carries for ccexp.plan, and
# the reference run a DoReMi sampler option carries (the `reference` stage trains it)
_META_KEYS = ("name", "tokenizer", "level", "heldout_fraction", "heldout_stratify", "heldout_min_per_value",
              "shard_documents", "threads", "fsdp", "architecture", "reference_steps", "reference_documents")


def build(node: DictConfig, group: str, **runtime: Any) -> Any:
    """Instantiate ``node`` (a config group entry with ``_target_``) with ``runtime`` keyword arguments.

    Raises:
        CcexpError: if the target cannot be imported or rejects the arguments (the group is named).
        Other exceptions from the constructor propagate unchanged (a CcexpError stays one line).
    """
    cfg = OmegaConf.to_container(node, resolve=True)
    for key in _META_KEYS:
        cfg.pop(key, None)
    try:
        return instantiate(cfg, **runtime, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, CcexpError):
            raise cause from None
        if cause is not None and not isinstance(cause, (TypeError, ImportError, AttributeError)):
            raise cause
        msg = str(e).strip().splitlines()[-1]
        raise CcexpError(f"{group}: cannot build {cfg.get('_target_')!r}: {msg}") from None


def check_buildable(node: DictConfig, group: str, runtime: tuple[str, ...] = ()) -> None:
    """Fail fast, before any work, if ``node``'s target is missing or does not take one of its keys.

    Raises:
        CcexpError: naming the group, the key and the accepted keys.
    """
    import inspect

    from hydra.utils import get_method

    target = node.get("_target_")
    try:
        fn = get_method(target)
    except Exception:
        raise CcexpError(f"{group}._target_={target!r} cannot be imported; check the spelling") from None
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in node.keys():
        if key in _META_KEYS or key == "_target_" or key in runtime:
            continue
        if key not in params:
            accepted = sorted(k for k in params if k not in runtime and k != "self")
            raise CcexpError(f"{group}.{key} is not an option of {target}; accepted: {', '.join(accepted)}")
