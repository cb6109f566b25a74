"""Where a run continues from, and whether it needs to run at all: ``train.resume_from`` resolved against the
earlier runs of the same configuration (the same run name), each known by the ``run.json`` in its folder.

``run.json`` ([`write_run_json`][ccexp.launch.resume.write_run_json]) holds the run's name, its MLflow run id and
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
  (``-m``) a job looks only in its own folder (``null``, ``last`` and ``auto`` alike): a job stopped with a checkpoint
  continues it when the sweep is launched again into its folder, and a run of the same settings in another sweep
  folder is that sweep's, not this job's; a sweep keeps its finished jobs itself (``ccexp.launch.sweep``).
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

from ccexp.artifacts import NO_LOCKS, no_locks_warning, process_created
from ccexp.embedding.shards import launch_rank
from ccexp.errors import CcexpError
from ccexp.names import RunIdentity, config_identity

log = logging.getLogger("ccexp")


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
UNFINISHED = ("running", "stopped", "failed", "killed")
CLAIMS = ".running"  # under paths.outputs: one lock file per configuration digest, held while a run of it goes on
_HELD: dict[Path, int] = {}  # lock file -> its open, locked descriptor: the claims of runs of this process


def launch_id() -> str | None:
    """What the ranks of one torchrun/srun launch share (None outside a launch of several ranks): their
    run.json entries are one run, never "another run still going"."""
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(key) and int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1))) > 1:
            return f"{key}={os.environ[key]}"
    return None


# run.json's fields and the JSON types each must have (a hand edit, a half-merged file or another tool's writer can
# leave any of them of another type); None is allowed for every field
RUN_JSON_FIELDS: dict[str, tuple[type, ...]] = {
    "run_name": (str,), "status": (str,), "host": (str,), "pid": (int,), "pid_created": (float, int),
    "started": (float, int), "ended": (float, int), "launch": (str,), "mlflow_run_id": (str,),
    "slurm_job_id": (str, int), "steps": (int,), "step": (int,), "config_digest": (str,), "metrics": (dict,),
    "fingerprints": (dict,)}
_INNER = {"metrics": (float, int), "fingerprints": (str,)}  # the values of run.json's mappings
_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "an object", list: "a list",
               bool: "true or false"}


_WARNED_RUN_JSON: set[tuple[str, str]] = set()  # (path, what was wrong): said once per process


def _wrong_type(value, types: tuple[type, ...], none: bool = True) -> str | None:
    """"is a string, not an object" when ``value`` is none of ``types`` (a JSON true/false is no number; null only
    with ``none``), else None."""
    if (value is None and none) or (isinstance(value, types) and not isinstance(value, bool)):
        return None
    shown = "null" if value is None else _JSON_NAMES.get(type(value), type(value).__name__)
    return f"is {shown}, not {' or '.join(_JSON_NAMES[t] for t in types if not (t is int and float in types))}"


def read_run_json(path: Path) -> dict:
    """``path`` (a run folder's ``run.json``) as a mapping whose fields have the types
    [`RUN_JSON_FIELDS`][ccexp.launch.resume.RUN_JSON_FIELDS] names (``metrics`` a mapping of names to numbers,
    ``fingerprints`` of stage names to strings). A field of another type is left out, with one warning naming the
    file and the field ("metrics is a string, not an object"): the rest of the run's record still counts (a
    ``metrics`` edited by hand does not make a finished run train again). A field it does not name is kept as it is.

    Raises:
        OSError: when it cannot be read. ValueError: when it is not JSON (or nested too deeply to read).
            TypeError: when it is not a JSON object.
    """
    try:
        meta = json.loads(Path(path).read_text())
    except RecursionError:  # (a RuntimeError, not a ValueError)
        raise ValueError("its JSON is nested too deeply to read") from None
    if not isinstance(meta, dict):
        raise TypeError(f"a JSON {type(meta).__name__}, not an object")
    wrong = [f"{key} {why}" for key, types in RUN_JSON_FIELDS.items() if (why := _wrong_type(meta.get(key), types))]
    for key, inner in _INNER.items():
        if isinstance(meta.get(key), dict):
            wrong += [f"{key}[{k!r}] {why}" for k, v in meta[key].items() if (why := _wrong_type(v, inner, False))]
    for field_ in {w.split(" ")[0].split("[")[0] for w in wrong}:
        meta.pop(field_, None)
    if wrong and (str(path), "; ".join(wrong)) not in _WARNED_RUN_JSON:
        _WARNED_RUN_JSON.add((str(path), "; ".join(wrong)))
        log.warning("resume: %s: %s; %s left out of what this command reads of that run", path, "; ".join(wrong[:3]),
                    "that field is" if len(wrong) == 1 else "those fields are")
    return meta


def write_run_json(run_dir: Path, **fields) -> None:
    """Merge ``fields`` into ``run_dir/run.json`` (written whole or not at all). The first write of a run
    also records when it started, on which host and in which process (what a later run of the same
    configuration reads to tell a run still going from one that stopped)."""
    from ccexp.artifacts import write_text_atomic

    path = run_dir / RUN_JSON
    try:
        data = read_run_json(path)
    except (OSError, ValueError, TypeError):  # none yet, or unreadable: this run's own record starts again
        data = {}
    if fields.get("status") == "running" and data.get("status") in (None, "running"):
        data.update(started=time.time(), host=socket.gethostname(), pid=os.getpid(), pid_created=process_created(),
                    launch=launch_id())
    data.update(fields)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data))


def claim(outputs: Path, identity: RunIdentity, run_dir: Path | None) -> None:
    """Take this configuration's running claim: an exclusive ``flock`` on ``<outputs>/.running/<digest>.lock``, held
    until [`release_claims`][ccexp.launch.resume.release_claims] (the end of the run) or the process's end (the
    kernel drops the lock of a process that is gone, SIGKILL and a power cut included). Taken before any earlier run
    is looked at, so of two identical commands started at once exactly one trains. Only global rank 0 of a launch
    claims (the others follow it). A claim this process holds already is kept.

    Raises:
        CcexpError: in one line when another process holds the claim, naming it from the lock file.
    """
    import fcntl

    path = (Path(outputs) / CLAIMS / f"{identity.digest}.lock").resolve()
    if path in _HELD or launch_rank()[0] != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in NO_LOCKS:  # a file system without locks: nothing holds it, and nothing can
            os.close(fd)
            no_locks_warning(path.parent, e, "two identical commands started at once are not kept apart (both "
                             "would train)")
            return
        holder = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        try:
            who = json.loads(holder)
            where = f"pid {who['pid']} on {who['host']}, {who.get('run_dir') or 'its run folder'}"
        except (ValueError, KeyError, TypeError, RecursionError):
            where = "another process"
        raise CcexpError(f"{identity.name} is running now ({where}); wait for it, or stop it (Ctrl-C) and run the "
                         "same command again to continue it") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                              "run_dir": str(run_dir) if run_dir else None, "run_name": identity.name}).encode(), 0)
    _HELD[path] = fd


def release_claims() -> None:
    """Drop every claim this process holds (the end of a run, or of a sweep's job)."""
    import fcntl

    for fd in _HELD.values():
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    _HELD.clear()


@dataclass
class Earlier:
    """One earlier run of a configuration's name: its folder, its ``run.json`` and its readable checkpoints
    (newest first)."""

    folder: Path
    meta: dict
    started: float
    checkpoints: list[Path] = field(default_factory=list)

    @property
    def status(self) -> str | None:  # None: a run.json written before run states were recorded
        return self.meta.get("status")

    @property
    def digest(self) -> str | None:
        """Its configuration's full digest ([`ccexp.names.config_identity`][ccexp.names.config_identity]): from
        ``run.json``, or for a run from before ccexp recorded it, computed from the config Hydra saved in its folder
        (``.hydra/config.yaml``); None when neither can be read (then it is no configuration's run)."""
        if self.meta.get("config_digest"):
            return str(self.meta["config_digest"])
        try:
            from omegaconf import OmegaConf

            return config_identity(OmegaConf.to_container(OmegaConf.load(self.folder / ".hydra" / "config.yaml"),
                                                          resolve=True))
        except Exception:  # noqa: BLE001 (any unreadable, unresolvable or missing file: identity unknown)
            return None

    def alive(self) -> bool:
        """Still running: its process exists on this host, started before run.json recorded it (a pid given to
        another program since is not the run: [`ccexp.artifacts.pid_alive`][ccexp.artifacts.pid_alive]), and is
        not a rank of this very launch."""
        if self.status != "running" or self.meta.get("host") != socket.gethostname() or not self.meta.get("pid"):
            return False
        if self.meta.get("launch") is not None and self.meta.get("launch") == launch_id():
            return False
        from ccexp.artifacts import pid_alive

        try:
            pid = int(self.meta["pid"])
        except (TypeError, ValueError):  # a run.json edited by hand: no process to ask
            return False
        created = self.meta.get("pid_created")  # else when run.json says it started, or was last written
        return pid != os.getpid() and pid > 0 and pid_alive(pid, started_by=self.started or None,
                                                            created=float(created) if created else None)

    def describe(self) -> str:
        step, steps = self.meta.get("step"), self.meta.get("steps")
        at = f"step {step:,} of {steps:,}, " if isinstance(step, int) and isinstance(steps, int) else ""
        run_id = self.meta.get("mlflow_run_id")
        return f"{at}{self.folder}" + (f", MLflow run {run_id}" if run_id else "")


def earlier_runs(name: str, run_dir: Path | None, outputs: Path) -> list[Earlier]:
    """Every run folder of the name ``name``: ``run_dir`` itself, then every folder under ``outputs`` whose
    ``run.json`` carries that name; the newest start first. A name is not an identity: [`runs_of`][ccexp.launch.resume.runs_of]
    keeps those of one configuration."""
    folders = [run_dir] if run_dir is not None else []
    folders += [m.parent for m in [*outputs.glob(f"runs/**/{RUN_JSON}"), *outputs.glob(f"multirun/**/{RUN_JSON}")]]
    found = []
    for folder in dict.fromkeys(folders):
        path = folder / RUN_JSON
        try:
            meta = read_run_json(path)
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
        if meta.get("run_name") != name and not str(meta.get("run_name", "")).startswith(f"{name}"):
            continue
        ckpts = sorted((folder / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
        found.append(Earlier(folder, meta, started, ckpts))
    return sorted(found, key=lambda e: e.started, reverse=True)


def run_id_of(checkpoint: Path) -> str | None:
    """The MLflow run id recorded in the ``run.json`` of the run folder holding ``checkpoint``."""
    try:
        return read_run_json(checkpoint.parent.parent / RUN_JSON).get("mlflow_run_id")
    except (OSError, ValueError, TypeError):
        return None


@dataclass
class Resume:
    """checkpoint: the path to resume from (None: a fresh start); run_id: the MLflow run it was written by
    (None when unknown), which the resumed run continues; finished: the earlier run that already finished
    this configuration (the run has nothing to do); identity: the run's name (lengthened when another configuration
    holds the short one) and digest; dead: earlier runs of it whose process is gone while their run.json said
    running (now recorded ``killed``; their MLflow runs are ended by the next run record)."""

    checkpoint: str | None = None
    run_id: str | None = None
    finished: Earlier | None = None
    identity: RunIdentity | None = None
    dead: list[Earlier] = field(default_factory=list)


def runs_of(identity: RunIdentity, run_dir: Path | None, outputs: Path) -> tuple[list[Earlier], RunIdentity]:
    """The earlier runs of ``identity``'s configuration (the same full digest; newest first) and the identity with a
    name no other configuration's run holds ([`ccexp.names.RunIdentity.distinct`][ccexp.names.RunIdentity.distinct]):
    a run of the same short name and other settings is another configuration, never continued nor counted as
    finished, and said so in one line."""
    runs = earlier_runs(identity.name, run_dir, outputs)
    mine = [r for r in runs if r.folder == run_dir or r.digest == identity.digest]  # its own folder: a requeued job
    others = [r for r in runs if r not in mine]
    if others:
        distinct = identity.distinct({str(r.meta.get("run_name")) for r in others})
        log.info("resume: %d earlier run(s) named %s hold another configuration (%s%s): not this run, which is named "
                 "%s", len(others), identity.name, others[0].folder, "" if others[0].digest else
                 ", its settings unreadable", distinct.name)
        identity = distinct
    return mine, identity


def _gone(run: Earlier, outputs: Path) -> bool:
    """True when no process runs ``run`` (its run.json says running): on this host its pid is gone; elsewhere its
    configuration's claim ([`claim`][ccexp.launch.resume.claim]) is free (taken and dropped at once)."""
    import fcntl

    if run.meta.get("host") == socket.gethostname() and run.meta.get("pid"):
        return not run.alive()
    digest = run.meta.get("config_digest")
    path = (Path(outputs) / CLAIMS / f"{digest}.lock").resolve() if digest else None
    if path is None or not path.is_file() or path in _HELD:
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except OSError:  # held, or a file system without locks (NO_LOCKS): it cannot be told from here
        return False
    finally:
        os.close(fd)


def _bury(outputs: Path, run_dir: Path | None) -> list[Earlier]:
    """Every run under ``outputs`` (of any configuration) whose run.json says ``running`` while no process runs it
    ([`_gone`][ccexp.launch.resume._gone]: SIGKILL, the OOM killer, a node lost): recorded ``killed`` in its
    run.json, one line each; their MLflow runs are ended by the caller ([`end_dead_runs`][ccexp.launch.resume.end_dead_runs])."""
    dead = []
    for path in [*outputs.glob(f"runs/**/{RUN_JSON}"), *outputs.glob(f"multirun/**/{RUN_JSON}")]:
        if path.parent == run_dir:
            continue
        try:
            meta = read_run_json(path)
            running = meta.get("status") == "running"
        except (OSError, ValueError, TypeError):  # earlier_runs says so for this configuration's
            continue
        run = Earlier(path.parent, meta, float(meta.get("started") or path.stat().st_mtime)) if running else None
        if run is None or not _gone(run, outputs):
            continue
        run.checkpoints = sorted((run.folder / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime,
                                 reverse=True)
        ckpt = next((p for p in run.checkpoints if unreadable(p) is None), None)
        log.warning("resume: %s (%s) was killed (its process is gone; run.json still said running): %s",
                    meta.get("run_name", "a run"), run.describe(),
                    f"its newest checkpoint is {ckpt}" if ckpt else "it left no checkpoint")
        write_run_json(run.folder, status="killed", ended=time.time())
        run.meta["status"] = "killed"
        dead.append(run)
    return dead


def _newest_checkpoint(runs: list[Earlier]) -> Resume | None:
    for run in runs:
        for path in run.checkpoints:
            why = unreadable(path)
            if why is None:
                return Resume(str(path), run_id_of(path))
            log.warning("resume: %s is truncated or unreadable (%s); trying the next newest checkpoint", path, why)
    return None


def find_resume(resume_from: str | None, identity: RunIdentity, run_dir: Path | None, outputs: Path,
                multirun: bool = False, fingerprints: dict[str, str] | None = None) -> Resume:
    """``train.resume_from`` resolved (the module docstring says what each value does), after this configuration's
    running claim is taken ([`claim`][ccexp.launch.resume.claim]). Earlier runs count only when their full
    configuration digest is ``identity``'s ([`runs_of`][ccexp.launch.resume.runs_of]). ``fingerprints``: the
    stages' fingerprints so far; an earlier run recorded on another corpus (a file rewritten in place) is not
    this run: neither finished nor continued.

    Raises:
        CcexpError: when another process runs this configuration now ([`claim`][ccexp.launch.resume.claim]); for
            ``last`` when there is nothing to continue.
    """
    claim(outputs, identity, run_dir)
    runs, identity = runs_of(identity, run_dir, outputs)
    leader = launch_rank()[0] == 0  # the other ranks of a launch follow rank 0: rank 0's own run.json is "running"
    going = next((r for r in runs if r.alive()), None) if leader else None
    if going is not None:  # a run of ccexp from before claims, on this machine
        raise CcexpError(f"{identity.name} is running now (pid {going.meta['pid']}, {going.folder}); wait for it, or "
                         "stop it (Ctrl-C) and run the same command again to continue it")
    dead = _bury(Path(outputs), run_dir) if leader else []  # rank 0 records; the others follow it
    for run in (r for r in runs if any(d.folder == r.folder for d in dead)):  # this configuration's among them
        run.meta["status"] = "killed"
    if resume_from == "fresh":
        return Resume(identity=identity, dead=dead)
    if resume_from not in (None, "last", "auto"):
        return Resume(resume_from, run_id_of(Path(resume_from)), identity=identity, dead=dead)
    if multirun:  # a sweep job continues its own folder only: another sweep's run of the same settings is not this job
        runs = [r for r in runs if r.folder == run_dir]
    corpus = (fingerprints or {}).get("corpus")
    other = [r for r in runs if corpus and (r.meta.get("fingerprints") or {}).get("corpus", corpus) != corpus]
    for r in other[:1]:  # the same settings on a corpus that changed since (a file rewritten in place): not this run
        log.info("resume: %s %s on another corpus (fingerprint %s, now %s): not continued; this run starts from step "
                 "0", identity.name, r.status, (r.meta.get("fingerprints") or {}).get("corpus"), corpus)
    runs = [r for r in runs if r not in other]
    found = _resume_point(resume_from, runs, identity, outputs)
    found.identity, found.dead = identity, dead
    return found


def _resume_point(resume_from: str | None, runs: list[Earlier], identity: RunIdentity, outputs: Path) -> Resume:
    """The checkpoint to continue, the finished run, or a fresh start, from this configuration's earlier ``runs``."""
    finished = next((i for i, r in enumerate(runs) if r.status == "finished"), None)
    unfinished = runs if finished is None else runs[:finished]  # runs older than the last finished one are done with
    if resume_from is None:
        unfinished = [r for r in unfinished if r.status in UNFINISHED]  # runs from before run states: not guessed at
    found = _newest_checkpoint(unfinished)
    if found is not None:
        run = next(r for r in unfinished if Path(found.checkpoint) in r.checkpoints)
        if resume_from is None:
            log.warning("resume: %s %s (%s): continuing it from %s; train.resume_from=fresh starts again from "
                        "step 0", identity.name, run.status, run.describe(), found.checkpoint)
        else:
            log.info("resume: train.resume_from=%s is %s", resume_from, found.checkpoint)
        return found
    if finished is not None:  # newer attempts left no checkpoint (a bad setting, a stop before step 1): done
        return Resume(finished=runs[finished])
    if resume_from is None:
        stopped = next((r for r in unfinished if r.status in ("stopped", "failed", "killed")), None)
        if stopped is not None:
            log.warning("resume: %s %s before its first checkpoint (%s): starting from step 0", identity.name,
                        stopped.status, stopped.folder)
        return Resume()
    if resume_from == "auto":
        log.info("resume: train.resume_from=auto found no earlier checkpoint of %s; starting fresh", identity.name)
        return Resume()
    raise CcexpError(f"train.resume_from=last: no readable checkpoint of an unfinished run named {identity.name} "
                     f"under {outputs}; give a checkpoint path, or run without train.resume_from")


RUN_JSON_METRICS = ("ppl", "ppl_macro", "ppl_worst", "bpb")  # kept in run.json at the end


def end_dead_runs(client, dead: list) -> None:
    """End the MLflow runs of ``dead`` earlier runs ([`ccexp.launch.resume.Earlier`][ccexp.launch.resume.Earlier]
    whose process is gone, their run.json now ``killed``) that are still RUNNING: KILLED, with a tag saying who
    noticed. A store that cannot be reached now is one warning; the next run of the configuration tries again."""
    from mlflow.exceptions import MlflowException

    for run in dead:
        run_id = run.meta.get("mlflow_run_id")
        if not run_id:
            continue
        try:
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_tag(run_id, "ended_by", "the next run of its configuration: its process was gone")
                client.set_terminated(run_id, "KILLED")
                log.warning("mlflow: run %s (%s) was still RUNNING with its process gone: ended KILLED", run_id,
                            run.folder)
        except (MlflowException, OSError) as e:
            log.warning("mlflow: could not end the dead run %s (%s): %s", run_id, run.folder, str(e).splitlines()[0])


def finished_before(resume: Resume, cfg) -> dict[str, float]:
    """The configuration finished in ``resume.finished`` (an [`Earlier`][ccexp.launch.resume.Earlier]): one line,
    nothing trained and no MLflow run opened (the MLflow runs of ``resume.dead`` are ended, as a run record would);
    its headline metrics are the result."""
    run, resume_from = resume.finished, cfg.train.resume_from
    if resume.dead and cfg.logger.enabled and launch_rank()[0] == 0:
        from ccexp.tracking.server import LOCAL_STORE, client_for
        from ccexp.tracking.store import resolve_store

        outputs = Path(cfg.paths.outputs).resolve()
        store = resolve_store(cfg.logger.tracking_uri, f"sqlite:///{outputs / 'mlflow.db'}")
        end_dead_runs(client_for(store, resume.dead[0].folder / LOCAL_STORE), resume.dead)
    metrics = dict(run.meta.get("metrics") or {})
    shown = ", ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k in ("ppl", "ppl_macro"))
    log.warning(
        "ccexp: %s finished (%s%s); nothing to do%s; train.resume_from=fresh trains it again", run.meta["run_name"],
        run.describe(), f"; held-out {shown}" if shown else "",
        f" (train.resume_from={resume_from} continues only unfinished runs)" if resume_from else "")
    return metrics
