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


def build_loggers(node: DictConfig | None, run_name: str | None = None) -> list[Any]:
    """The loggers of ``logger.loggers`` (TensorBoard with ``logger=tensorboard``, W&B with ``logger=wandb``); an
    entry whose ``name`` is null is given ``run_name``, the run's MLflow name, so the run is called the same in
    every tracker."""
    if not node:
        return []
    return [build(node[key], f"logger.loggers.{key}",
                  **({"name": run_name} if run_name and "name" in node[key] and node[key].name is None else {}))
            for key in sorted(node) if node[key] is not None]


HPARAM_METRICS = ("eval/ppl_macro", "eval/ppl", "eval/ppl_worst", "eval/bpb")  # TensorBoard's HParams columns


def start_tensorboard(logger: Any, params: dict[str, Any]) -> None:
    """TensorBoard's HParams tab and axes for a run (``logger``: Lightning's ``TensorBoardLogger``): the run's
    settings as hparams with the headline held-out metrics as its metric columns (their values are the scalars
    the run logs at its end, so a stopped run shows its settings without them), and a Custom Scalars layout whose
    chart titles name the x axis: every ccexp scalar in TensorBoard is at the optimizer step (the held-out curve
    too, with ``curve/tokens_trained`` beside it)."""
    from torch.utils.tensorboard.summary import hparams

    values = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
    writer = logger.experiment._get_file_writer()
    for summary in hparams(values, {m: 0.0 for m in HPARAM_METRICS}):
        writer.add_summary(summary)

    logger.experiment.add_custom_scalars({  # a chart's tags are regular expressions (TensorBoard's Multiline)
        "ccexp: held-out curve (x: optimizer step)": {
            "held-out sample ppl": ["Multiline", [r"curve/ppl(_macro|_worst)?$"]],
            "tokens trained": ["Multiline", [r"curve/tokens_trained$"]]},
        "ccexp: training (x: optimizer step)": {
            "loss": ["Multiline", [r"train/loss"]], "learning rate": ["Multiline", [r"lr"]]}})


def build_callbacks(node: DictConfig | None) -> list[Any]:
    """The callbacks of the root ``callbacks`` group (``callbacks=[lr_monitor,device_stats]``, ``debug=overfit``)."""
    return build_all(node, "callbacks")
