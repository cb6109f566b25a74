"""The one helper through which ccexp creates configured objects (around ``hydra.utils.instantiate``)."""
from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ccexp.errors import CcexpError


def settings(node: DictConfig, group: str) -> set[str]:
    """The keys of ``group``'s option ``node`` that its schema declares settings for ccexp, not constructor
    arguments ([`ccexp.config.setting`][ccexp.config.setting]); for a ``_target_`` no schema names, those of every schema
    of the group."""
    from ccexp import config

    schema = config.schema_for(group, node.get("_target_"))
    if schema is not None:
        return config.settings_of(schema)
    return set().union(*(config.settings_of(cls) for g, _, cls in config.GROUP_SCHEMAS if g == group))


def build(node: DictConfig, group: str, **runtime: Any) -> Any:
    """Instantiate ``node`` (a config group entry with ``_target_``) with ``runtime`` keyword arguments;
    the keys its schema declares settings ([`settings`][ccexp.build.settings]) are not passed.

    Raises:
        CcexpError: if the target cannot be imported or rejects the arguments (the group is named).
        Other exceptions from the constructor propagate unchanged (a CcexpError stays one line).
    """
    cfg = OmegaConf.to_container(node, resolve=True)
    for key in settings(node, group):
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
    skip = settings(node, group)
    for key in node.keys():
        if key in skip or key == "_target_" or key in runtime:
            continue
        if key not in params:
            accepted = sorted(k for k in params if k not in runtime and k != "self")
            raise CcexpError(f"{group}.{key} is not an option of {target}; accepted: {', '.join(accepted)}")
