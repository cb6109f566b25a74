"""Sweeps that finish what can finish: job status files, an MLflow parent run that is always closed, a
comparison report of the jobs that finished, and a summary of the ones that did not.

:class:`MlflowSweepCallback` is a Hydra callback (``hydra.callbacks`` in ``ccexp/conf/config.yaml``).
When a multirun starts it refuses, in one line and before any job, a Lightning strategy that would
re-launch the script (the children would re-run the whole sweep), then creates one MLflow run for the
sweep and exports its id as ``CCEXP_PARENT_RUN_ID``; every job's run carries the
``mlflow.parentRunId`` tag, which the MLflow UI uses to nest the jobs under the sweep.

Every job writes ``status.json`` into its folder (:func:`write_job_status`): FINISHED, or FAILED /
KILLED with its one error line — a failing job does not stop the sweep (the entry point turns its
error into a status instead of an exception). When the multirun ends the callback reads the job
folders, writes the comparison report of the finished jobs into the sweep folder (logged on the
parent), closes the parent FINISHED or FAILED, and leaves the failures in :data:`LAST_SWEEP_FAILURES`
for the entry point to print and exit non-zero. The status files work for any launcher (in-process,
joblib, Slurm), since they live on the file system.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("ccexp")
STATUS_FILE = "status.json"
LAST_SWEEP_FAILURES: list[str] = []  # "#<job> (<overrides>): <line>" of the last multirun in this process
_ACTIVE: "MlflowSweepCallback | None" = None  # the running sweep, so an interrupt can close its parent


def write_job_status(job_dir: Path, status: str, message: str = "") -> None:
    """Record a job's end: ``status`` FINISHED, FAILED or KILLED, with its one-line ``message``."""
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / f".{STATUS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"status": status, "message": message}))
    os.replace(tmp, job_dir / STATUS_FILE)


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

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _ACTIVE
        from ccexp.errors import CcexpError, Refused
        from ccexp.preflight import refuse_relaunch_in_multirun

        try:
            refuse_relaunch_in_multirun(config)  # before any job: one line, not one failure per job
        except CcexpError as e:
            raise Refused(str(e)) from None
        target = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
        if target.endswith("SlurmLauncher"):
            import shutil

            if shutil.which("sbatch") is None:
                raise Refused("hydra/launcher=slurm submits jobs with sbatch, which is not on this machine; run the "
                              "sweep from a Slurm login node, or try it here with hydra/launcher=local")
        LAST_SWEEP_FAILURES.clear()
        _ACTIVE = self
        from ccexp.config import sweep_id

        os.environ["CCEXP_SWEEP_ID"] = sweep_id()  # jobs in other processes (submitit) share the sweep folder
        if not config.logger.enabled:
            return
        from ccexp.tracking.mlflow_run import PARENT_ENV, ensure_experiment, open_store, tracking_uri

        outputs = Path(config.paths.outputs).resolve()
        self.uri = tracking_uri(config.logger.tracking_uri, outputs)
        client = open_store(self.uri)
        experiment_id = ensure_experiment(client, config.logger.experiment,
                                          config.logger.artifact_location or outputs / "mlartifacts")
        sweep_dir = Path(config.hydra.sweep.dir)
        overrides = " ".join(config.hydra.overrides.task)
        run = client.create_run(experiment_id, run_name=f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}",
                                tags={"ccexp.sweep": "true", "sweep_dir": str(sweep_dir.resolve()),
                                      "overrides": overrides[:5000]})
        self.parent_id = run.info.run_id
        os.environ[PARENT_ENV] = self.parent_id
        log.info("mlflow: sweep parent run %s (%s)", run.info.run_name, self.parent_id)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _ACTIVE
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = job_statuses(sweep_dir)
        failed = [f"#{job} ({overrides}): {message}" for job, overrides, status, message in jobs if status != "FINISHED"]
        LAST_SWEEP_FAILURES[:] = failed
        log.info("sweep: %d of %d job(s) finished%s", len(jobs) - len(failed), len(jobs),
                 "; failed: " + "; ".join(failed) if failed else "")
        try:
            if self.parent_id is not None and len(failed) < len(jobs):
                self._report(sweep_dir / "report")
        finally:
            self.close("FAILED" if failed else "FINISHED")
            _ACTIVE = None
            from ccexp.config import _SWEEP_ID

            os.environ.pop("CCEXP_SWEEP_ID", None)
            _SWEEP_ID.clear()  # the next sweep of this process gets its own folder

    def _report(self, out: Path) -> None:
        from mlflow import MlflowClient

        from ccexp.tracking.report import write_report

        client = MlflowClient(self.uri)
        files = write_report(client, parent_run_id=self.parent_id, out_dir=out)
        for path in files:
            client.log_artifact(self.parent_id, str(path), "report")
        log.info("report: %s", out / "report.md")

    def close(self, status: str) -> None:
        """Mark the parent run ``status`` (FINISHED, FAILED or KILLED) and stop exporting its id."""
        from ccexp.tracking.mlflow_run import PARENT_ENV

        if self.parent_id is not None:
            from mlflow import MlflowClient

            MlflowClient(self.uri).set_terminated(self.parent_id, status)
            self.parent_id = None
        os.environ.pop(PARENT_ENV, None)


def close_active_sweep(status: str) -> None:
    """Close the running sweep's parent run (an interrupt or a crash of the sweep itself)."""
    if _ACTIVE is not None:
        _ACTIVE.close(status)
