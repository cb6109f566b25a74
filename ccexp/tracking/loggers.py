"""The extra loggers of ``logger.loggers`` (TensorBoard, W&B, any Lightning logger given by its ``_target_``) started
before any stage, one way for all of them: [`trial_start`][ccexp.tracking.loggers.trial_start] checks every folder
option can be made and starts the logger for real in a scratch folder, so a setting it refuses (a ``save_dir`` under a
file or on a read-only mount, an option its writer does not take) is one line in the pre-flight, not a traceback
after the embedding. [`close_logger`][ccexp.tracking.loggers.close_logger] ends one (the run's, and the trial's)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ccexp.artifacts import folder_problem
from ccexp.build import build
from ccexp.errors import CcexpError


def folder_options(entry: DictConfig) -> dict[str, str]:
    """The options of a logger entry that name a folder it writes (``save_dir``, ``log_dir``, ``dir``, ...: every
    string option whose name ends in ``dir``)."""
    return {k: str(v) for k, v in entry.items() if isinstance(k, str) and k.endswith("dir") and isinstance(v, str)}


def close_logger(logger: Any, status: str = "success") -> None:
    """Flush and close a Lightning logger: ``finalize``, and a W&B run is finished (so that the next run of a sweep
    in this process opens its own rather than continuing this one)."""
    from lightning.pytorch.loggers import WandbLogger

    logger.finalize(status)
    if isinstance(logger, WandbLogger) and logger._experiment is not None:
        logger.experiment.finish(exit_code=0 if status == "success" else 1)


def trial_start(entry: DictConfig, key: str) -> None:
    """Start the logger of ``entry`` (``logger.loggers.<name>``, named ``key`` in the lines) as a run would, in a
    scratch folder that is removed after: each of its folder options, and the folder it will write
    (``logger.log_dir``), must be one this user can make, and the logger's own writer must start
    (``logger.experiment``) and take a first value with the rest of its options as given.

    Raises:
        CcexpError: one line naming the option and why, or the logger and its writer's error.
    """
    for option, value in folder_options(entry).items():
        problem = folder_problem(Path(value))
        if problem is not None:
            raise CcexpError(f"{key}.{option}={value!r} cannot be made ({problem}); give a folder you can write")
    log_dir = build(entry, key).log_dir  # the folder it will write (save_dir/name/version for TensorBoard, ...)
    problem = folder_problem(Path(log_dir)) if log_dir else None
    if problem is not None:
        raise CcexpError(f"{key} writes into {log_dir}, which cannot be made ({problem}); change its save_dir or "
                         "name")
    with tempfile.TemporaryDirectory(prefix="ccexp-logger-") as scratch:
        trial = OmegaConf.to_container(entry, resolve=True)
        trial.update({option: str(Path(scratch) / option) for option in folder_options(entry)})
        try:
            logger = build(OmegaConf.create(trial), key)
            logger.experiment  # noqa: B018  (the writer starts here: SummaryWriter, wandb.init, ...)
            logger.log_metrics({"ccexp/trial_start": 0.0}, step=0)  # and takes a first value (CSV: its flushing)
            close_logger(logger)
        except CcexpError:
            raise
        except Exception as e:  # noqa: BLE001 (each library's own exception: the line names the logger)
            line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
            raise CcexpError(f"{key} ({entry._target_}) cannot start: {type(e).__name__}: {line}") from None
