"""Where a run continues from, and whether it needs to run at all: ``train.resume_from`` resolved against the
earlier runs of the same configuration (the same run name), each known by the ``run.json`` in its folder.

``run.json`` ([`write_run_json`][ccexp.tracking.resume.write_run_json]) holds the run's name, its MLflow run id and
its state: ``running`` from its start, then ``finished`` (with its step and headline metrics), ``stopped`` (a
signal or a callback ended it early: Ctrl-C, Slurm's notice, ``callbacks=timer``) or ``failed``. The earlier
runs are looked for in the run's own folder (a requeued sweep job or a sweep launched again into its folder
lands there, with its ``last.ckpt``), then in every run folder under ``<outputs>/runs`` and
``<outputs>/multirun``.

What each value does (docs/using.md, "Stopping and continuing"):

- ``null`` (the default), for a single run: when the newest earlier run of this configuration *finished*, the
  run says ``finished (...); nothing to do`` and trains nothing (no new MLflow run); when it *stopped* or
  failed and left a checkpoint, the run continues it (its MLflow run too) and says so in one line; when it
  is still running on this machine, the run is refused in one line. Otherwise a fresh start. In a sweep
  (``-m``) ``null`` is a fresh start: a sweep keeps its finished jobs itself (``ccexp.tracking.sweep``).
- ``fresh``: from step 0, whatever ran before (a new MLflow run of the same name).
- ``last``: the newest readable checkpoint of an *unfinished* run of this configuration (runs older than its
  newest finished run do not count); ``finished; nothing to do`` when the configuration finished; an error
  when there is nothing to continue.
- ``auto``: as ``last``, but a fresh start when there is nothing to continue (jobs a scheduler may requeue).
- a path: that checkpoint.

A truncated or unreadable checkpoint (a disk that filled, a kill mid-write on a file system without atomic
renames) is skipped with a warning naming it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import zipfile
from dataclasses import dataclass, field
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
    checkpoint is a folder with torch.distributed.checkpoint's ``.metadata`` (written once every rank's shard is) and
    Lightning's ``meta.pt`` (written after it), renamed into place whole
    ([`ccexp.training.distributed.FSDPStrategy.save_checkpoint`][ccexp.training.distributed.FSDPStrategy.save_checkpoint])."""
    try:
        if path.is_dir():
            missing = [name for name in (".metadata", "meta.pt") if not (path / name).is_file()]
            if missing:
                return f"a sharded checkpoint folder without its {' and '.join(missing)}"
            with zipfile.ZipFile(path / "meta.pt") as z:
                z.namelist()
            return None
        with zipfile.ZipFile(path) as z:
            z.namelist()
        return None
    except (OSError, zipfile.BadZipFile) as e:
        return f"{type(e).__name__}: {e}"


RUN_JSON = "run.json"
UNFINISHED = ("running", "stopped", "failed")


def launch_id() -> str | None:
    """What the ranks of one torchrun/srun launch share (None outside a launch of several ranks): their
    run.json entries are one run, never "another run still going"."""
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(key) and int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1))) > 1:
            return f"{key}={os.environ[key]}"
    return None


def write_run_json(run_dir: Path, **fields) -> None:
    """Merge ``fields`` into ``run_dir/run.json`` (written whole or not at all). The first write of a run
    also records when it started, on which host and in which process (what a later run of the same
    configuration reads to tell a run still going from one that stopped)."""
    from ccexp.artifacts import write_text_atomic

    path = run_dir / RUN_JSON
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    if fields.get("status") == "running" and data.get("status") in (None, "running"):
        data.update(started=time.time(), host=socket.gethostname(), pid=os.getpid(), launch=launch_id())
    data.update(fields)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data))


@dataclass
class Earlier:
    """One earlier run of this configuration: its folder, its ``run.json`` and its readable checkpoints
    (newest first)."""

    folder: Path
    meta: dict
    started: float
    checkpoints: list[Path] = field(default_factory=list)

    @property
    def status(self) -> str | None:  # None: a run.json written before run states were recorded
        return self.meta.get("status")

    def alive(self) -> bool:
        """Still running: its process exists on this host (and is not a rank of this very launch)."""
        if self.status != "running" or self.meta.get("host") != socket.gethostname() or not self.meta.get("pid"):
            return False
        if self.meta.get("launch") is not None and self.meta.get("launch") == launch_id():
            return False
        from ccexp.artifacts import pid_alive

        try:
            pid = int(self.meta["pid"])
        except (TypeError, ValueError):  # a run.json edited by hand: no process to ask
            return False
        return pid != os.getpid() and pid > 0 and pid_alive(pid)

    def describe(self) -> str:
        step, steps = self.meta.get("step"), self.meta.get("steps")
        at = f"step {step:,} of {steps:,}, " if isinstance(step, int) and isinstance(steps, int) else ""
        run_id = self.meta.get("mlflow_run_id")
        return f"{at}{self.folder}" + (f", MLflow run {run_id}" if run_id else "")


def earlier_runs(name: str, run_dir: Path | None, outputs: Path) -> list[Earlier]:
    """Every run folder of the configuration ``name``: ``run_dir`` itself, then every folder under ``outputs``
    whose ``run.json`` carries that name; the newest start first."""
    folders = [run_dir] if run_dir is not None else []
    folders += [m.parent for m in [*outputs.glob(f"runs/**/{RUN_JSON}"), *outputs.glob(f"multirun/**/{RUN_JSON}")]]
    found = []
    for folder in dict.fromkeys(folders):
        path = folder / RUN_JSON
        try:
            meta = json.loads(path.read_text())
            if not isinstance(meta, dict):
                raise TypeError(f"a JSON {type(meta).__name__}, not an object")
            started = float(meta.get("started") or path.stat().st_mtime)
        except (OSError, ValueError, TypeError) as e:
            if path.is_file() and folder != run_dir:
                log.warning("resume: %s is not readable (%s); that run is left out of what this command finds",
                            path, f"{type(e).__name__}: {e}"[:200])
            if folder == run_dir and (folder / "checkpoints").is_dir():  # a requeued job's own folder, as new
                meta = {"run_name": name}  # as its newest checkpoint (it has no run.json to say when it started)
                started = max((p.stat().st_mtime for p in (folder / "checkpoints").glob("*.ckpt")), default=0.0)
            else:
                continue
        if meta.get("run_name") != name:
            continue
        ckpts = sorted((folder / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
        found.append(Earlier(folder, meta, started, ckpts))
    return sorted(found, key=lambda e: e.started, reverse=True)


def run_id_of(checkpoint: Path) -> str | None:
    """The MLflow run id recorded in the ``run.json`` of the run folder holding ``checkpoint``."""
    meta = checkpoint.parent.parent / RUN_JSON
    try:
        return json.loads(meta.read_text()).get("mlflow_run_id")
    except (OSError, ValueError):
        return None


@dataclass
class Resume:
    """checkpoint: the path to resume from (None: a fresh start); run_id: the MLflow run it was written by
    (None when unknown), which the resumed run continues; finished: the earlier run that already finished
    this configuration (the run has nothing to do)."""

    checkpoint: str | None = None
    run_id: str | None = None
    finished: Earlier | None = None


def _newest_checkpoint(runs: list[Earlier]) -> Resume | None:
    for run in runs:
        for path in run.checkpoints:
            why = unreadable(path)
            if why is None:
                return Resume(str(path), run_id_of(path))
            log.warning("resume: %s is truncated or unreadable (%s); trying the next newest checkpoint", path, why)
    return None


def find_resume(resume_from: str | None, name: str, run_dir: Path | None, outputs: Path,
                multirun: bool = False, fingerprints: dict[str, str] | None = None) -> Resume:
    """``train.resume_from`` resolved (the module docstring says what each value does). ``fingerprints``: the
    stages' fingerprints so far; an earlier run recorded on another corpus (a file rewritten in place) is not
    this run: neither finished nor continued.

    Raises:
        CcexpError: for ``last`` when there is nothing to continue; for a single run of a configuration that
            is still running on this machine (its process is alive).
    """
    if resume_from == "fresh" or (resume_from is None and multirun):
        return Resume()
    if resume_from not in (None, "last", "auto"):
        return Resume(resume_from, run_id_of(Path(resume_from)))
    runs = earlier_runs(name, run_dir, outputs)
    corpus = (fingerprints or {}).get("corpus")
    other = [r for r in runs if corpus and (r.meta.get("fingerprints") or {}).get("corpus", corpus) != corpus]
    for r in other[:1]:  # the same settings on a corpus that changed since (a file rewritten in place): not this run
        log.info("resume: %s %s on another corpus (fingerprint %s, now %s): not continued; this run starts from step "
                 "0", name, r.status, (r.meta.get("fingerprints") or {}).get("corpus"), corpus)
    runs = [r for r in runs if r not in other]
    going = next((r for r in runs if r.alive()), None)
    if going is not None:
        raise CcexpError(f"{name} is running now (pid {going.meta['pid']}, {going.folder}); wait for it, or stop it "
                         "(Ctrl-C) and run the same command again to continue it; train.resume_from=fresh starts "
                         "another from step 0")
    finished = next((i for i, r in enumerate(runs) if r.status == "finished"), None)
    unfinished = runs if finished is None else runs[:finished]  # runs older than the last finished one are done with
    if resume_from is None:
        unfinished = [r for r in unfinished if r.status in UNFINISHED]  # runs from before run states: not guessed at
    found = _newest_checkpoint(unfinished)
    if found is not None:
        run = next(r for r in unfinished if Path(found.checkpoint) in r.checkpoints)
        if resume_from is None:
            log.warning("resume: %s %s (%s): continuing it from %s; train.resume_from=fresh starts again from "
                        "step 0", name, run.status, run.describe(), found.checkpoint)
        else:
            log.info("resume: train.resume_from=%s is %s", resume_from, found.checkpoint)
        return found
    if finished is not None:  # newer attempts left no checkpoint (a bad setting, a stop before step 1): done
        return Resume(finished=runs[finished])
    if resume_from is None:
        stopped = next((r for r in unfinished if r.status in ("stopped", "failed")), None)
        if stopped is not None:
            log.warning("resume: %s %s before its first checkpoint (%s): starting from step 0", name, stopped.status,
                        stopped.folder)
        return Resume()
    if resume_from == "auto":
        log.info("resume: train.resume_from=auto found no earlier checkpoint of %s; starting fresh", name)
        return Resume()
    raise CcexpError(f"train.resume_from=last: no readable checkpoint of an unfinished run named {name} under "
                     f"{outputs}; give a checkpoint path, or run without train.resume_from")


RUN_JSON_METRICS = ("ppl", "ppl_macro", "ppl_worst", "bpb")  # kept in run.json at the end


def finished_before(run, resume_from: str | None) -> dict[str, float]:
    """The configuration finished in ``run`` (an [`Earlier`][ccexp.tracking.resume.Earlier]): one line, nothing
    trained and no MLflow run opened; its headline metrics are the result."""
    metrics = dict(run.meta.get("metrics") or {})
    shown = ", ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k in ("ppl", "ppl_macro"))
    log.warning(
        "ccexp: %s finished (%s%s); nothing to do%s; train.resume_from=fresh trains it again", run.meta["run_name"],
        run.describe(), f"; held-out {shown}" if shown else "",
        f" (train.resume_from={resume_from} continues only unfinished runs)" if resume_from else "")
    return metrics
