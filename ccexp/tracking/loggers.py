"""The extra loggers of ``logger.loggers`` (TensorBoard, W&B, any Lightning logger given by its ``_target_``) started
before any stage, one way for all of them: [`trial_start`][ccexp.tracking.loggers.trial_start] checks every folder
option can be made and starts the logger for real in a scratch folder, so a setting it refuses (a ``save_dir`` under a
file or on a read-only mount, an option its writer does not take) is one line in the pre-flight, not a traceback
after the embedding. [`close_logger`][ccexp.tracking.loggers.close_logger] ends one (the run's, and the trial's)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ccexp.build import build
from ccexp.errors import CcexpError


def folder_problem(path: Path) -> str | None:
    """Why folder ``path`` cannot be made or written (its nearest existing ancestor is a file, or not writable),
    or None when it can."""
    path = Path(path).expanduser().absolute()
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return "no part of it exists"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder" if probe != path else "it is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None


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
    scratch folder that is removed after: each of its folder options must be one this user can make, and the logger's
    own writer must start (``logger.experiment``) with the rest of its options as given.

    Raises:
        CcexpError: one line naming the option and why, or the logger and its writer's error.
    """
    for option, value in folder_options(entry).items():
        problem = folder_problem(Path(value))
        if problem is not None:
            raise CcexpError(f"{key}.{option}={value!r} cannot be made ({problem}); give a folder you can write")
    with tempfile.TemporaryDirectory(prefix="ccexp-logger-") as scratch:
        trial = OmegaConf.to_container(entry, resolve=True)
        trial.update({option: str(Path(scratch) / option) for option in folder_options(entry)})
        try:
            logger = build(OmegaConf.create(trial), key)
            logger.experiment  # noqa: B018  (the writer starts here: SummaryWriter, wandb.init, ...)
            close_logger(logger)
        except CcexpError:
            raise
        except Exception as e:  # noqa: BLE001 (each library's own exception: the line names the logger)
            line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
            raise CcexpError(f"{key} ({entry._target_}) cannot start: {type(e).__name__}: {line}") from None
