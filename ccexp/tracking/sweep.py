"""MLflow parent runs for Hydra multiruns.

:class:`MlflowSweepCallback` is a Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``). When a
multirun starts it creates one MLflow run for the sweep, named after the sweep folder, and exports
its id as ``CCEXP_PARENT_RUN_ID``; every job's run then carries the ``mlflow.parentRunId`` tag, which
the MLflow UI uses to nest the jobs under the sweep. When the multirun ends the parent is closed and
the comparison report of its jobs (:mod:`ccexp.report`) is written into the sweep folder and logged
as the parent's artifacts.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("ccexp")


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.parent_id: str | None = None
        self.uri: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not config.logger.enabled:
            return
        from mlflow import MlflowClient

        from ccexp.tracking.mlflow_run import PARENT_ENV, ensure_experiment, tracking_uri

        outputs = Path(config.paths.outputs).resolve()
        self.uri = tracking_uri(config.logger.tracking_uri, outputs)
        client = MlflowClient(self.uri)
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
        if self.parent_id is None:
            return
        from mlflow import MlflowClient

        from ccexp.tracking.mlflow_run import PARENT_ENV
        from ccexp.tracking.report import write_report

        client = MlflowClient(self.uri)
        try:
            out = Path(config.hydra.sweep.dir) / "report"
            files = write_report(client, parent_run_id=self.parent_id, out_dir=out)
            for path in files:
                client.log_artifact(self.parent_id, str(path), "report")
            log.info("report: %s", out / "report.md")
        finally:
            client.set_terminated(self.parent_id, "FINISHED")
            os.environ.pop(PARENT_ENV, None)
