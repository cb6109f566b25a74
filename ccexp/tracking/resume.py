"""Where a run continues from: ``train.resume_from=last|auto`` resolved to a checkpoint, and the MLflow
run that checkpoint belongs to (which the resumed run continues instead of opening a second one).

The search looks first in the run's own folder — a requeued sweep job (Slurm, submitit) or a sweep
launched again into its folder lands there, with its ``last.ckpt`` — then in every earlier run of the
same configuration (the same run name, in its ``run.json``) under ``<outputs>/runs`` and
``<outputs>/multirun``. The newest checkpoint that reads whole wins; a truncated or unreadable one
(a disk that filled, a kill mid-write on a file system without atomic renames) is skipped with a
warning naming it.
"""
from __future__ import annotations

import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


@dataclass
class Resume:
    """checkpoint: the path to resume from (None: a fresh start); run_id: the MLflow run it was written by
    (None when unknown), which the resumed run continues."""

    checkpoint: str | None = None
    run_id: str | None = None


def unreadable(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be resumed from (None when it reads whole): a Lightning checkpoint is
    a zip archive whose directory sits at its end, so a truncated file has none; a sharded (FSDP)
    checkpoint is a folder with its ``.metadata``."""
    try:
        if path.is_dir():
            return None if (path / ".metadata").is_file() else "a sharded checkpoint folder without its .metadata"
        with zipfile.ZipFile(path) as z:
            z.namelist()
        return None
    except (OSError, zipfile.BadZipFile) as e:
        return f"{type(e).__name__}: {e}"


def run_id_of(checkpoint: Path) -> str | None:
    """The MLflow run id recorded in the ``run.json`` of the run folder holding ``checkpoint``."""
    meta = checkpoint.parent.parent / "run.json"
    try:
        return json.loads(meta.read_text()).get("mlflow_run_id")
    except (OSError, ValueError):
        return None


def candidates(name: str, run_dir: Path | None, outputs: Path) -> list[Path]:
    """Every checkpoint of the run ``name``: in ``run_dir`` itself, then in every run folder under
    ``outputs`` whose ``run.json`` carries that name; the newest first."""
    folders = [run_dir] if run_dir is not None else []
    for meta in [*outputs.glob("runs/**/run.json"), *outputs.glob("multirun/**/run.json")]:
        try:
            if json.loads(meta.read_text()).get("run_name") == name:
                folders.append(meta.parent)
        except (OSError, ValueError):
            continue
    found = {p for folder in dict.fromkeys(folders) for p in (folder / "checkpoints").glob("*.ckpt")}
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def find_resume(resume_from: str | None, name: str, run_dir: Path | None, outputs: Path) -> Resume:
    """``train.resume_from`` resolved: a path is taken as given; ``last`` is the newest readable checkpoint
    of this configuration (see the module docstring); ``auto`` is the same, or a fresh start when there
    is none (jobs a scheduler may requeue).

    Raises:
        CcexpError: for ``last`` when no readable checkpoint exists.
    """
    if resume_from is None:
        return Resume()
    if resume_from not in ("last", "auto"):
        return Resume(resume_from, run_id_of(Path(resume_from)))
    for path in candidates(name, run_dir, outputs):
        why = unreadable(path)
        if why is None:
            log.info("resume: train.resume_from=%s is %s", resume_from, path)
            return Resume(str(path), run_id_of(path))
        log.warning("resume: %s is truncated or unreadable (%s); trying the next newest checkpoint", path, why)
    if resume_from == "auto":
        log.info("resume: train.resume_from=auto found no earlier checkpoint of %s; starting fresh", name)
        return Resume()
    raise CcexpError(f"train.resume_from=last: no readable checkpoint of an earlier run named {name} under {outputs}; "
                     "give a checkpoint path, or run without train.resume_from")
