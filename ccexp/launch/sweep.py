"""Sweeps that finish what can finish, and can be extended: job status files, an MLflow parent run that
is always closed, duplicate arms skipped before training, a comparison report with its verdict, and
a summary of the jobs that did not finish.

[`MlflowSweepCallback`][ccexp.launch.sweep.MlflowSweepCallback] is a Hydra callback (``hydra.callbacks`` in ``ccexp/conf/config.yaml``).
When a multirun starts it refuses, in one line and before any job, a Lightning strategy that would
re-launch the script (the children would re-run the whole sweep); then it plans every job's token
stream and records the jobs that would train on the identical stream as an earlier job
([`ccexp.launch.arms`][ccexp.launch.arms]; the entry point skips them), and creates one MLflow run for the sweep —
or reopens the one recorded in the folder's ``sweep.json`` when the sweep is launched again into the
same ``hydra.sweep.dir`` — exporting its id as ``CCEXP_PARENT_RUN_ID``; every job's run carries the
``mlflow.parentRunId`` tag, which the MLflow UI uses to nest the jobs under the sweep.

Every job writes ``status.json`` into its folder ([`write_job_status`][ccexp.launch.sweep.write_job_status]), with its overrides:
FINISHED, SKIPPED (a duplicate arm), or FAILED / KILLED with its one error line — a failing job does
not stop the sweep (the entry point turns its error into a status instead of an exception). Job
folders are named by what sets the job apart (``<sampler>-s<seed>-<hash of its overrides>``), so a
job launched again into the same sweep folder finds its own: a FINISHED job is kept, not retrained
([`finished_before`][ccexp.launch.sweep.finished_before]), a failed one runs again. When the multirun ends the callback reads the job
folders, writes the comparison report of the finished jobs into the sweep folder (logged on the
parent), prints its verdict, closes the parent FINISHED or FAILED, and leaves the failures in
[`LAST_SWEEP_FAILURES`][ccexp.launch.sweep.LAST_SWEEP_FAILURES] for the entry point to print and exit non-zero. The status files work
for any launcher (in-process, joblib, Slurm), since they live on the file system.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ccexp.artifacts import process_created, write_text_atomic
from ccexp.launch.arms import job_config, job_overrides
from ccexp.launch.status import STATUS_FILE, SWEEP_STOPPED, write_job_status  # noqa: F401  (the job's side's)

log = logging.getLogger("ccexp")
LAST_SWEEP_FAILURES: list[str] = []  # "#<job> (<overrides>): <line>" of the last multirun in this process
SWEEP_RECORD = "sweep.json"  # <sweep_dir>/sweep.json: the sweep's command, its launching process, its MLflow parent
_ACTIVE: "MlflowSweepCallback | None" = None  # the running sweep, so an interrupt can close its parent


def finished_before(job_dir: Path, overrides: list[str]) -> bool:
    """True when ``job_dir`` holds the FINISHED status of a job with the same ``overrides``: an earlier launch
    of this sweep trained it, so it is kept, not retrained."""
    from ccexp.launch.arms import same_job

    path = job_dir / STATUS_FILE
    if not path.is_file():
        return False
    status = json.loads(path.read_text())
    return status.get("status") == "FINISHED" and same_job(status.get("overrides") or [], overrides)


def job_statuses(sweep_dir: Path) -> list[tuple[str, str, str, str]]:
    """(job folder, the overrides that set it apart from the other jobs, status, message) of every job
    folder under ``sweep_dir``; a job that left no status file (killed hard) counts as FAILED."""
    import yaml

    jobs = sorted((p.parent for p in sweep_dir.glob("*/.hydra")), key=lambda p: (len(p.name), p.name))
    overrides = [yaml.safe_load((j / ".hydra" / "overrides.yaml").read_text()) or []
                 if (j / ".hydra" / "overrides.yaml").is_file() else [] for j in jobs]
    common = set.intersection(*(set(o) for o in overrides)) if len(jobs) > 1 else set()
    out = []
    for job, own in zip(jobs, overrides):
        status = json.loads((job / STATUS_FILE).read_text()) if (job / STATUS_FILE).is_file() else \
            {"status": "FAILED", "message": "the job ended without a status (killed?); see its ccexp.log"}
        out.append((job.name, " ".join(o for o in own if o not in common), status["status"], status["message"]))
    return out


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.parent_id: str | None = None
        self.uri: str | None = None
        self.client = None  # the parent's client: MLflow's, or a FallbackClient on a tracking server
        self.sweep_dir: Path | None = None
        self.argv: list[str] = []  # the sweep's command line, for the line that says how to continue it
        self.jobs = 0  # how many jobs the sweep launches (0: a sweeper that does not say in advance)

    def __getstate__(self) -> dict:
        """What a launcher (joblib, submitit) sends its workers with the job: not the parent's client (a store's
        open engine, a FallbackClient's lock), which only the launching process uses."""
        return {**self.__dict__, "client": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _ACTIVE
        from ccexp.errors import CcexpError, Refused
        from ccexp.preflight import refuse_relaunch_in_multirun

        from ccexp.runtime import quiet_libraries

        quiet_libraries()  # the sweep plans its jobs' streams here (FAISS's loader lines, Lightning's tips)
        try:
            refuse_relaunch_in_multirun(config)  # before any job: one line, not one failure per job
        except CcexpError as e:
            raise Refused(str(e)) from None
        sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
        if sweeper.endswith("BasicSweeper"):  # every value of every sweep list, before any job (and on Slurm)
            from hydra import compose

            from ccexp.preflight import check_sweep_values

            params = [f"{k}={v}" for k, v in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
            try:
                check_sweep_values(params + list(config.hydra.overrides.task),
                                   lambda overrides: compose(config_name="config", overrides=overrides))
            except CcexpError as e:
                raise Refused(str(e)) from None
        check_launcher(config)
        if config.logger.enabled:  # the parent's store, said and (a server) asked before any stage or job
            from ccexp.tracking.mlflow_run import check_store

            try:
                check_store(config.logger, Path(config.paths.outputs).resolve())
            except CcexpError as e:
                raise Refused(str(e)) from None
        LAST_SWEEP_FAILURES.clear()
        SWEEP_STOPPED.clear()
        sweep_dir = self._folder(config)
        _ACTIVE = self
        from ccexp.launch.arms import check_arms

        try:
            duplicates = check_arms(config, sweep_dir)  # before any training: jobs with identical streams
        except CcexpError as e:
            raise Refused(str(e)) from None
        if not config.logger.enabled:
            return
        from ccexp.tracking.mlflow_run import PARENT_ENV

        self.uri, self.client, self.parent_id = self._parent_run(config, sweep_dir)
        cost = self._cost(config, duplicates)
        if cost:
            log.info("%s", cost)
            self.client.set_tag(self.parent_id, "ccexp.cost", cost[:5000])
        self.client.set_tag(self.parent_id, "ccexp.duplicates", json.dumps(
            [{k: d[k] for k in ("job", "sampler", "seed", "same_as", "same_as_job")} for d in duplicates])[:5000])
        self._record_plan(config)
        os.environ[PARENT_ENV] = self.parent_id

    def _record_plan(self, config: DictConfig) -> None:
        """The sweep's comparison plan on its parent run, before its first job (``verdict.PLAN_TAG``). A sweep
        launched again in its folder keeps the plan of its first launch; a launch asking another question is said
        to be post hoc."""
        from ccexp.compare.verdict import PLAN_TAG, comparison_plan, metric_name

        plan = comparison_plan(config)
        earlier = self.client.get_run(self.parent_id).data.tags.get(PLAN_TAG)
        if earlier is None:
            self.client.set_tag(self.parent_id, PLAN_TAG, json.dumps(plan))
            log.info("sweep: the question, fixed before the first job: %s against %s (minimum effect %.0f%%, seeds "
                     "%s); every other metric is exploratory", metric_name(plan["primary"]), plan["baseline"],
                     100 * plan["min_effect"], plan["seeds"])
            return
        first = json.loads(earlier)
        if first.get("primary") != plan["primary"]:
            log.warning("sweep: this sweep's question was fixed at its first launch (%s, %s); report.primary=%s now is "
                        "post hoc, and its report says so", metric_name(first.get("primary", "?")),
                        first.get("recorded", "?"), plan["primary"])

    def _folder(self, config: DictConfig) -> Path:
        """The sweep's folder: the one an earlier launch of the same command wrote
        ([`same_command_sweep`][ccexp.launch.sweep.same_command_sweep]: that sweep continues), else a new one; its
        ``sweep.json`` records the command and this process.

        Raises:
            Refused: when the same sweep runs now."""
        import socket
        import time

        from ccexp.config import sweep_id
        from ccexp.errors import CcexpError, Refused

        try:
            earlier = None if "CCEXP_SWEEP_ID" in os.environ else same_command_sweep(config)
        except CcexpError as e:
            raise Refused(str(e)) from None
        # jobs in other processes (submitit, joblib) share the sweep folder
        os.environ["CCEXP_SWEEP_ID"] = sweep_id() if earlier is None else earlier
        sweep_dir = Path(config.hydra.sweep.dir)
        if earlier is not None:
            log.info("sweep: continuing %s, launched before with the same command: finished jobs are kept, stopped "
                     "ones continue from their checkpoints (hydra.sweep.dir=<another folder> or "
                     "train.resume_from=fresh starts a new sweep)", sweep_dir)
        update_sweep_record(sweep_dir, command=sweep_command(config), pid=os.getpid(), host=socket.gethostname(),
                            launched=time.time(), pid_created=process_created())
        self.sweep_dir, self.argv = sweep_dir, list(sys.argv[1:])
        self.jobs = len(job_overrides(config) or [])
        return sweep_dir

    def _cost(self, config: DictConfig, duplicates: list[dict]) -> str | None:
        """The sweep's cost before it starts ([`sweep_cost`][ccexp.launch.sweep.sweep_cost]), from the
        store's earlier runs of the same model; None for a sweeper whose jobs are not known in advance."""
        from hydra import compose

        jobs = job_overrides(config)
        if jobs is None:
            return None
        skipped = {d["job"] for d in duplicates} if OmegaConf.select(config, "report.skip_duplicates",
                                                                      default=True) else set()
        composed: dict = {}  # jobs that differ only in their seed share one composition
        configs = [job_config(composed, o, compose) for i, o in enumerate(jobs) if i not in skipped]
        exp = self.client.get_experiment_by_name(config.logger.experiment)
        earlier = [] if exp is None else self.client.search_runs(
            [exp.experiment_id], "attributes.status = 'FINISHED'", max_results=200,
            order_by=["attributes.start_time DESC"])
        return sweep_cost(configs, earlier)

    @staticmethod
    def _parent_run(config: DictConfig, sweep_dir: Path):
        """(tracking URI, its client, the id of the sweep's MLflow parent run): the run ``<sweep_dir>/sweep.json``
        names when this sweep folder was launched before into the same store (reopened: the sweep is being
        extended or resumed), else a new one, recorded there. The store is the jobs' own
        ([`ccexp.tracking.mlflow_run.run_store`][ccexp.tracking.mlflow_run.run_store]), so the parent and its children are in one place; on a
        tracking server the parent writes through a FallbackClient (its local store: ``<sweep_dir>/mlflow-local``)."""
        from ccexp.tracking.mlflow_run import ensure_experiment, run_store
        from ccexp.tracking.server import LOCAL_STORE, client_for, start_run

        outputs = Path(config.paths.outputs).resolve()
        store = run_store(config.logger.tracking_uri, outputs)
        uri = store.uri
        client = client_for(store, sweep_dir / LOCAL_STORE)
        artifacts = config.logger.artifact_location or (None if store.is_server else outputs / "mlartifacts")
        overrides = " ".join(config.hydra.overrides.task)
        saved = read_sweep_record(sweep_dir)
        if saved.get("tracking_uri") == uri:
            from mlflow.exceptions import MlflowException

            experiment_id = ensure_experiment(client.server if store.is_server else client, config.logger.experiment,
                                              artifacts, local=not store.is_server)
            try:
                run = client.get_run(saved["parent_run_id"])
            except MlflowException:
                run = None
            if run is not None and run.info.experiment_id == experiment_id:
                if store.is_server:
                    client.adopt(run.info.run_id, config.logger.experiment, run.info.run_name)
                client.update_run(run.info.run_id, status="RUNNING")
                client.set_tag(run.info.run_id, "overrides", overrides[:5000])
                log.info("mlflow: sweep parent run %s (%s) reopened: this sweep folder was launched before; its "
                         "finished jobs are kept", run.info.run_name, run.info.run_id)
                return uri, client, run.info.run_id
        name = f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}"
        run_id = start_run(client, config.logger.experiment, name, {
            "ccexp.sweep": "true", "sweep_dir": str(sweep_dir.resolve()), "overrides": overrides[:5000]}, artifacts,
            local=not store.is_server)
        update_sweep_record(sweep_dir, tracking_uri=uri, parent_run_id=run_id)
        log.info("mlflow: sweep parent run %s (%s)", name, run_id)
        return uri, client, run_id

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _ACTIVE
        sweep_dir = Path(config.hydra.sweep.dir)
        if SWEEP_STOPPED:  # a signal stopped the jobs (hydra/launcher=packed): no report of a sweep cut short
            try:
                self.stop_summary(str(SWEEP_STOPPED[0]))
            finally:
                self.close("KILLED")
                self._forget()
            return
        jobs = job_statuses(sweep_dir)
        failed = [f"#{job} ({overrides}): {message}" for job, overrides, status, message in jobs
                  if status not in ("FINISHED", "SKIPPED")]
        skipped = sum(status == "SKIPPED" for _, _, status, _ in jobs)
        LAST_SWEEP_FAILURES[:] = failed
        log.info("sweep: %d of %d job(s) finished%s%s", len(jobs) - len(failed) - skipped, len(jobs),
                 f", {skipped} skipped as duplicate arms" if skipped else "",
                 "; failed: " + "; ".join(failed) if failed else "")
        try:
            if self.parent_id is not None:
                close_left_running(self.uri, sweep_dir, jobs)
            if self.parent_id is not None and len(failed) + skipped < len(jobs):
                self._report(sweep_dir / "report", config.report, [
                    f"#{job} ({overrides}): {status}: {message}" for job, overrides, status, message in jobs
                    if status not in ("FINISHED", "SKIPPED")])
        finally:
            self.close("FAILED" if failed else "FINISHED")
            self._forget()

    @staticmethod
    def _forget() -> None:
        """This process runs no sweep any more: the next one gets its own folder."""
        global _ACTIVE
        from ccexp.config import _SWEEP_ID

        _ACTIVE = None
        os.environ.pop("CCEXP_SWEEP_ID", None)
        _SWEEP_ID.clear()

    def stop_summary(self, stop: str) -> list[str]:
        """Log and return what a stop left of the sweep: a line for each job that did not finish (stopped after step n
        with its checkpoint, stopped before one, not started) and the command that continues the sweep. The MLflow run
        of a job killed hard, still RUNNING, is ended KILLED."""
        if self.sweep_dir is None:
            return []
        jobs = job_statuses(self.sweep_dir)
        if self.uri is not None:
            close_left_running(self.uri, self.sweep_dir, [(j, o, "KILLED", m) for j, o, s, m in jobs
                                                          if s not in ("FINISHED", "SKIPPED")])
        done = sum(status in ("FINISHED", "SKIPPED") for _, _, status, _ in jobs)
        lines = []
        for job, overrides, status, message in jobs:
            if status in ("FINISHED", "SKIPPED"):
                continue
            progress = job_progress(self.sweep_dir / job) or (message if message.startswith("not started") else
                                                              f"{message}, before training; starts from step 0")
            lines.append(f"  #{job} ({overrides}): {progress}")
        unstarted = sum(m.startswith("not started") for _, _, s, m in jobs if s == "KILLED")  # folders, not started
        waiting = max(0, self.jobs - len(jobs)) + unstarted  # and the jobs that never got a folder
        head = (f"sweep: {stop}: {done} of {self.jobs or len(jobs)} job(s) finished, {len(lines) - unstarted} stopped"
                + (f", {waiting} not started" if waiting else ""))
        tail = f"sweep: to continue it (finished jobs kept, stopped ones from their checkpoints): {self.continue_command()}"
        for line in [head, *lines, tail]:
            log.warning("%s", line)
        return [head, *lines, tail]

    def continue_command(self) -> str:
        """The sweep's own command line with its folder named (the same command alone finds the folder too)."""
        import shlex

        args = [a for a in self.argv if not a.startswith("hydra.sweep.dir=")]
        return "python -m ccexp " + " ".join(shlex.quote(a) for a in [*args, f"hydra.sweep.dir={self.sweep_dir}"])

    def _report(self, out: Path, options: DictConfig, unfinished: list[str] = ()) -> None:
        from ccexp.compare.report import (headline_differences, parent_description, sampler_chart, sampler_summary,
                                           write_report)
        from ccexp.tracking.server import FallbackClient, unreachable
        from ccexp.compare.verdict import VERDICT_TAG, arm_verdicts, verdict_lines

        try:  # the report reads the jobs' runs from the store
            files, comparison = write_report(self.client, parent_run_id=self.parent_id, out_dir=out,
                                             baseline=options.baseline, min_effect=float(options.min_effect),
                                             power=float(options.power), unfinished=unfinished,
                                             primary=str(options.primary))
        except Exception as e:  # noqa: BLE001
            why = unreachable(e) if isinstance(self.client, FallbackClient) else None
            if why is None:
                raise
            log.warning("report: the tracking server %s does not answer (%s), so the sweep's report was not written; "
                        "once it is back: python -m ccexp.report --tracking-uri %s --parent %s --out %s", self.uri, why,
                        self.uri, self.parent_id, out)
            return
        chart = sampler_chart(out / "by_sampler.png", comparison, comparison.primary)  # the parent's first artifact
        for path in ([chart] if chart else []):
            self.client.log_artifact(self.parent_id, str(path))
        for path in files:
            self.client.log_artifact(self.parent_id, str(path), "report")
        for run_id, values in headline_differences(comparison).items():  # the MLflow view's "vs random pct" columns
            for key, value in values.items():
                self.client.log_metric(run_id, key, value)
        rows, command = comparison.verdict()
        for g, words in arm_verdicts(comparison, rows).items():  # the view groups the runs by it: verdict first
            for r in comparison.groups.get(g, []):
                self.client.set_tag(r.info.run_id, VERDICT_TAG, words)
        lines = verdict_lines(comparison, rows, command)
        for key, value in sampler_summary(comparison, comparison.primary).items():  # each sampler at a glance
            self.client.log_metric(self.parent_id, key, value)
        self.client.set_tag(self.parent_id, "mlflow.note.content", parent_description(comparison, lines))
        for line in lines:
            log.info("%s", line)
        for note in comparison.left_out:
            log.warning("report: %s", note)
        log.info("report: %s", out / "report.md")

    def close(self, status: str) -> None:
        """Mark the parent run ``status`` (FINISHED, FAILED or KILLED) and stop exporting its id; on a tracking
        server that went away, one line says where the parent's writes are (its FallbackClient)."""
        from ccexp.tracking.mlflow_run import PARENT_ENV
        from ccexp.tracking.server import FallbackClient

        if self.parent_id is not None:
            self.client.set_terminated(self.parent_id, status)
            if isinstance(self.client, FallbackClient):
                self.client.close()
            self.parent_id = None
        os.environ.pop(PARENT_ENV, None)



def check_launcher(config: DictConfig) -> None:
    """The launcher's own settings, before any job or stage: ``hydra/launcher=packed``'s ``runs_per_device``,
    and ``sbatch`` on this machine for ``hydra/launcher=slurm``.

    Raises:
        Refused: with the one line that says what to change.
    """
    from ccexp.errors import CcexpError, Refused

    target = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    if target.endswith("PackedLauncher"):  # its setting, before any stage is computed for the stream plans
        from ccexp.launch.packing import Packing

        try:
            Packing(OmegaConf.select(config, "hydra.launcher.runs_per_device", default=2), 0, 1)
        except CcexpError as e:
            raise Refused(str(e)) from None
    if target.endswith("SlurmLauncher"):
        import shutil

        if shutil.which("sbatch") is None:
            raise Refused("hydra/launcher=slurm submits jobs with sbatch, which is not on this machine; run the "
                          "sweep from a Slurm login node, or try it here with hydra/launcher=local")


def close_left_running(uri: str, sweep_dir: Path, jobs: list[tuple[str, str, str, str]]) -> None:
    """Close the MLflow run of every job that did not finish but left its run RUNNING (a job killed
    hard: SIGKILL, a failed node, out of memory): KILLED when the job's status is KILLED, else FAILED,
    with the job's line as its ``error`` tag. At the sweep's end no job runs any more."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from ccexp.launch.resume import read_run_json

    client = MlflowClient(uri)
    for job, _, status, message in jobs:
        meta = sweep_dir / job / "run.json"
        if status in ("FINISHED", "SKIPPED") or not meta.is_file():
            continue
        try:
            run_id = read_run_json(meta).get("mlflow_run_id")
            if not run_id or client.get_run(run_id).info.status != "RUNNING":
                continue
        except (OSError, ValueError, TypeError, MlflowException):
            continue
        closed = "KILLED" if status == "KILLED" else "FAILED"
        client.set_tag(run_id, "error", message[:5000])
        client.set_terminated(run_id, closed)
        log.warning("mlflow: the run of job %s was left RUNNING by its job (%s): closed %s", job, message, closed)


def close_active_sweep(status: str, stop: str | None = None) -> list[str]:
    """Close the running sweep's parent run (an interrupt or a crash of the sweep itself); for a ``stop`` (the
    signal's line), first log and return what is left to continue ([`MlflowSweepCallback.stop_summary`][ccexp.launch.sweep.MlflowSweepCallback.stop_summary])."""
    if _ACTIVE is None:
        return []
    active, lines = _ACTIVE, []
    try:
        if stop is not None:
            lines = active.stop_summary(stop)
    finally:
        active.close(status)
        active._forget()
    return lines


def job_progress(job_dir: Path) -> str | None:
    """How far a job that did not finish got, from its run.json and checkpoints: "stopped after step 12 of 80;
    continues from <checkpoint>", "stopped before its first checkpoint", or None when it left no run.json."""
    from ccexp.launch.resume import RUN_JSON, read_run_json

    try:
        meta = read_run_json(job_dir / RUN_JSON)
    except (OSError, ValueError, TypeError):
        return None
    checkpoints = sorted((job_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    step, steps = meta.get("step"), meta.get("steps")
    at = f" at step {step} of {steps}" if isinstance(step, int) and isinstance(steps, int) else ""
    state = meta.get("status") or "stopped"
    return (f"{state}{at}; continues from {checkpoints[0]}" if checkpoints else
            f"{state}{at} before its first checkpoint; starts again from step 0")


def read_sweep_record(sweep_dir: Path) -> dict:
    """``<sweep_dir>/sweep.json`` as a mapping ({} when absent or unreadable)."""
    try:
        saved = json.loads((Path(sweep_dir) / SWEEP_RECORD).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply to read
        return {}
    return saved if isinstance(saved, dict) else {}


def update_sweep_record(sweep_dir: Path, **fields: Any) -> None:
    """Merge ``fields`` into ``<sweep_dir>/sweep.json`` (written whole, atomically)."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(sweep_dir / SWEEP_RECORD, json.dumps({**read_sweep_record(sweep_dir), **fields}))


def sweep_command(config: DictConfig) -> list[str]:
    """What makes two sweep commands the same sweep: the task overrides as given (sweep lists included), sorted.
    The launcher and its settings (``hydra.*``) are not part of it: a sweep may continue under another launcher."""
    return sorted(str(o) for o in config.hydra.overrides.task)


def same_command_sweep(config: DictConfig) -> str | None:
    """The sweep folder (as ``CCEXP_SWEEP_ID``: its path under ``<paths.outputs>/multirun``) that an earlier launch of
    the same command ([`sweep_command`][ccexp.launch.sweep.sweep_command]) wrote, the newest; None when there is none
    or the sweep's folder is set (``hydra.sweep.dir``, a recipe's own).

    Raises:
        CcexpError: when the process that launched that sweep runs now on this machine.
    """
    import socket

    from ccexp.artifacts import pid_alive
    from ccexp.errors import CcexpError

    if "${ccexp.sweep_id:}" not in str(OmegaConf.to_container(config.hydra.sweep, resolve=False).get("dir", "")):
        return None
    root = Path(str(config.paths.outputs)).resolve() / "multirun"
    command = sweep_command(config)
    found = [(saved.get("launched") or 0.0, path.parent) for path in root.glob(f"*/*/{SWEEP_RECORD}")
             if (saved := read_sweep_record(path.parent)).get("command") == command]
    if not found:
        return None
    _, folder = max(found, key=lambda f: f[0])
    saved = read_sweep_record(folder)
    pid = saved.get("pid")
    launched, created = saved.get("launched"), saved.get("pid_created")
    if saved.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() and \
            pid_alive(pid, started_by=float(launched) if isinstance(launched, (int, float)) else None,
                      created=float(created) if isinstance(created, (int, float)) else None):
        raise CcexpError(f"the same sweep is running now (pid {pid}, {folder}); wait for it, or stop it (Ctrl-C) and "
                         "run the same command again to continue it")
    return str(folder.relative_to(root))


def sweep_cost(configs: list, earlier: list) -> str:
    """One line: what the sweep about to run costs, before any job starts. ``configs``: each job's composed
    config (skipped duplicates left out); ``earlier``: finished MLflow runs of this store, of which those with the
    jobs' model and accelerator give the throughput (the median ``train/tokens_per_s`` and time outside training).
    A job whose budget is ``train.passes`` sets its steps once its corpus is tokenized: with ``train.max_steps`` it is
    counted at that cap (the line says "at most"), without one it is left out and the line says so."""
    from ccexp.compare.budget import device_time, throughput
    from ccexp.tracking.mlflow_run import flatten

    def steps(c) -> int | None:  # the job's steps, or their cap under train.passes; None: known once tokenized
        return int(c.train.steps) if c.train.passes is None else (
            int(c.train.max_steps) if c.train.get("max_steps") else None)

    sized = [c for c in configs if steps(c) is not None]
    capped = any(c.train.passes is not None for c in sized)
    tokens = sum(steps(c) * int(c.train.tokens_per_step) for c in sized)
    head = f"sweep: {len(configs)} job(s), {'at most ' if capped else ''}{tokens / 1e6:,.2f} M training tokens" + (
        f" in the {len(sized)} with train.steps (train.passes sets the others' once the corpus is tokenized)"
        if len(sized) < len(configs) else " (train.passes, capped by train.max_steps)" if capped else "")
    if not sized:
        return (f"sweep: {len(configs)} job(s); their budget is train.passes, which sets the steps once the corpus is "
                "tokenized: each job's train: line gives its tokens")
    model = {f"model.{k}": v for k, v in flatten(sized[0].model).items()}
    device = str(sized[0].trainer.accelerator)
    like = [r for r in earlier if all(r.data.params.get(k) == v for k, v in model.items())
            and r.data.params.get("trainer.accelerator") == device]
    rate, extra = throughput(like)
    if not like or rate != rate:
        return head + ("; no earlier run of this model on this device in the store to take a speed from (the first "
                       "job's `done:` line gives it)")
    hours = sum(steps(c) * int(c.train.tokens_per_step) / rate + extra for c in sized) / 3600
    unit = "GPU" if device in ("gpu", "cuda") else "CPU"
    return head + (f"; at {rate:,.0f} tokens/s and {extra:.0f} s outside training per run (the median of "
                   f"{len(like)} earlier run(s) of this model here): {'at most' if capped else 'about'} "
                   f"{device_time(hours, unit)}, one job after another")
