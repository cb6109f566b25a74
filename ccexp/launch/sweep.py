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
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ccexp.artifacts import write_text_atomic

log = logging.getLogger("ccexp")
STATUS_FILE = "status.json"
LAST_SWEEP_FAILURES: list[str] = []  # "#<job> (<overrides>): <line>" of the last multirun in this process
_ACTIVE: "MlflowSweepCallback | None" = None  # the running sweep, so an interrupt can close its parent


def write_job_status(job_dir: Path, status: str, message: str = "", overrides: list[str] | None = None) -> None:
    """Record a job's end: ``status`` FINISHED, SKIPPED, FAILED or KILLED, with its one-line ``message``
    and the ``overrides`` that set the job (so a later launch into the same folder recognises it)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(job_dir / STATUS_FILE,
                      json.dumps({"status": status, "message": message, "overrides": list(overrides or [])}))


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
        _ACTIVE = self
        from ccexp.config import sweep_id

        os.environ["CCEXP_SWEEP_ID"] = sweep_id()  # jobs in other processes (submitit) share the sweep folder
        sweep_dir = Path(config.hydra.sweep.dir)
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
        os.environ[PARENT_ENV] = self.parent_id

    def _cost(self, config: DictConfig, duplicates: list[dict]) -> str | None:
        """The sweep's cost before it starts ([`sweep_cost`][ccexp.launch.sweep.sweep_cost]), from the
        store's earlier runs of the same model; None for a sweeper whose jobs are not known in advance."""
        from hydra import compose

        from ccexp.launch.arms import job_overrides

        jobs = job_overrides(config)
        if jobs is None:
            return None
        skipped = {d["job"] for d in duplicates} if OmegaConf.select(config, "report.skip_duplicates",
                                                                      default=True) else set()
        configs = [compose(config_name="config", overrides=o) for i, o in enumerate(jobs) if i not in skipped]
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
        record = sweep_dir / "sweep.json"
        saved = json.loads(record.read_text()) if record.is_file() else {}
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
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, json.dumps({"tracking_uri": uri, "parent_run_id": run_id}))
        log.info("mlflow: sweep parent run %s (%s)", name, run_id)
        return uri, client, run_id

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _ACTIVE
        sweep_dir = Path(config.hydra.sweep.dir)
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
            _ACTIVE = None
            from ccexp.config import _SWEEP_ID

            os.environ.pop("CCEXP_SWEEP_ID", None)
            _SWEEP_ID.clear()  # the next sweep of this process gets its own folder

    def _report(self, out: Path, options: DictConfig, unfinished: list[str] = ()) -> None:
        from ccexp.compare.report import (headline_differences, parent_description, sampler_chart, sampler_summary,
                                           write_report)
        from ccexp.tracking.server import FallbackClient, unreachable
        from ccexp.compare.verdict import verdict_lines

        try:  # the report reads the jobs' runs from the store
            files, comparison = write_report(self.client, parent_run_id=self.parent_id, out_dir=out,
                                             baseline=options.baseline, min_effect=float(options.min_effect),
                                             power=float(options.power), unfinished=unfinished)
        except Exception as e:  # noqa: BLE001
            why = unreachable(e) if isinstance(self.client, FallbackClient) else None
            if why is None:
                raise
            log.warning("report: the tracking server %s does not answer (%s), so the sweep's report was not written; "
                        "once it is back: python -m ccexp.report --tracking-uri %s --parent %s --out %s", self.uri, why,
                        self.uri, self.parent_id, out)
            return
        chart = sampler_chart(out / "by_sampler.png", comparison)  # the parent run's first artifact
        for path in ([chart] if chart else []):
            self.client.log_artifact(self.parent_id, str(path))
        for path in files:
            self.client.log_artifact(self.parent_id, str(path), "report")
        for run_id, values in headline_differences(comparison).items():  # the MLflow view's "vs random pct" columns
            for key, value in values.items():
                self.client.log_metric(run_id, key, value)
        lines = verdict_lines(comparison, *comparison.verdict())
        for key, value in sampler_summary(comparison).items():  # the parent's Metrics: each sampler at a glance
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

    client = MlflowClient(uri)
    for job, _, status, message in jobs:
        meta = sweep_dir / job / "run.json"
        if status in ("FINISHED", "SKIPPED") or not meta.is_file():
            continue
        try:
            run_id = json.loads(meta.read_text()).get("mlflow_run_id")
            if not run_id or client.get_run(run_id).info.status != "RUNNING":
                continue
        except (OSError, ValueError, MlflowException):
            continue
        closed = "KILLED" if status == "KILLED" else "FAILED"
        client.set_tag(run_id, "error", message[:5000])
        client.set_terminated(run_id, closed)
        log.warning("mlflow: the run of job %s was left RUNNING by its job (%s): closed %s", job, message, closed)


def close_active_sweep(status: str) -> None:
    """Close the running sweep's parent run (an interrupt or a crash of the sweep itself)."""
    if _ACTIVE is not None:
        _ACTIVE.close(status)


def sweep_cost(configs: list, earlier: list) -> str:
    """One line: what the sweep about to run costs, before any job starts. ``configs``: each job's composed
    config (skipped duplicates left out); ``earlier``: finished MLflow runs of this store, of which those with the
    jobs' model and accelerator give the throughput (the median ``train/tokens_per_s`` and time outside training).
    A job whose budget is ``train.passes`` is counted once its corpus is tokenized, so not here."""
    from ccexp.compare.budget import throughput
    from ccexp.tracking.mlflow_run import flatten

    sized = [c for c in configs if c.train.passes is None]
    tokens = sum(int(c.train.steps) * int(c.train.tokens_per_step) for c in sized)
    head = f"sweep: {len(configs)} job(s), {tokens / 1e6:,.2f} M training tokens" + (
        f" in the {len(sized)} with train.steps (train.passes sets the others' once the corpus is tokenized)"
        if len(sized) < len(configs) else "")
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
    hours = sum(int(c.train.steps) * int(c.train.tokens_per_step) / rate + extra for c in sized) / 3600
    unit = "GPU" if device in ("gpu", "cuda") else "CPU"
    return head + (f"; at {rate:,.0f} tokens/s and {extra:.0f} s outside training per run (the median of "
                   f"{len(like)} earlier run(s) of this model here): about {hours:,.2f} {unit}-hours, one job after "
                   "another")
