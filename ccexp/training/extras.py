"""The Lightning loggers and callbacks a run adds from its config, each a mapping with ``_target_``:
``logger.loggers.<name>`` (beside the MLflow logger the run record makes) and ``callbacks.<name>``
(beside ccexp's own). A new one is a YAML file under ``conf/logger/`` or ``conf/callbacks/``, no code."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from ccexp.build import build


def build_all(node: DictConfig | None, group: str) -> list[Any]:
    """Each entry of ``node`` (name -> mapping with ``_target_``; None or empty: none), built in name order;
    an entry set to null is left out (``callbacks.lr_monitor=null`` drops one of a combination).

    Raises:
        CcexpError: naming ``group.<name>`` when an entry's target cannot be built.
    """
    if not node:
        return []
    return [build(node[name], f"{group}.{name}") for name in sorted(node) if node[name] is not None]


def build_loggers(node: DictConfig | None) -> list[Any]:
    """The loggers of ``logger.loggers`` (TensorBoard with ``logger=tensorboard``)."""
    return build_all(node, "logger.loggers")


def build_callbacks(node: DictConfig | None) -> list[Any]:
    """The callbacks of the root ``callbacks`` group (``callbacks=[lr_monitor,device_stats]``, ``debug=overfit``)."""
    return build_all(node, "callbacks")
