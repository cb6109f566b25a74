"""MLflow tracking, owned by one [`RunRecord`][ccexp.tracking.mlflow_run.RunRecord]: on a SQLite store (never the deprecated file store) or
a team's tracking server.

The store is, as MLflow's own clients decide it, ``logger.tracking_uri`` when set, else
``MLFLOW_TRACKING_URI``, else ``<outputs>/mlflow.db`` with artifacts in ``<outputs>/mlartifacts``, both
absolute, so runs launched from any folder land in one place and compare in one UI
(``mlflow ui --backend-store-uri sqlite:///<outputs>/mlflow.db``). On a server the run writes through
[`ccexp.tracking.server.FallbackClient`][ccexp.tracking.server.FallbackClient], so a server that goes away never stops it.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ccexp.errors import CcexpError
from ccexp.names import metric_keys, run_identity
from ccexp.tracking.store import ensure_experiment, open_store  # noqa: F401  (the store helpers, as before)

log = logging.getLogger("ccexp")
PARENT_ENV = "CCEXP_PARENT_RUN_ID"  # set by a sweep's parent run (ccexp.launch.sweep) for its jobs


def tracking_uri(uri: str | None, outputs: Path) -> str:
    """The run's tracking URI ([`run_store`][ccexp.tracking.mlflow_run.run_store])."""
    return run_store(uri, outputs).uri


def run_store(uri: str | None, outputs: Path):
    """The store of a run or sweep with ``logger.tracking_uri=uri``: that URI when set, else
    ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<outputs>/mlflow.db``; a relative sqlite path is made
    absolute. A [`ccexp.tracking.server.Store`][ccexp.tracking.store.Store] (its URI and where it came from)."""
    from ccexp.tracking.store import resolve_store

    return resolve_store(uri, f"sqlite:///{(outputs / 'mlflow.db').resolve()}")


def check_store(logger_cfg, outputs: Path) -> None:
    """Say which store a run uses and where that came from (its first line), and check a server answers; only
    rank 0 of a torchrun/srun launch, which alone records the run.

    Raises:
        CcexpError: for a server that does not answer ([`ccexp.tracking.server.check_server`][ccexp.tracking.store.check_server]), or a
            SQLite store that cannot be read ([`ccexp.tracking.store.check_sqlite`][ccexp.tracking.store.check_sqlite]).
    """
    from ccexp.embedding.shards import launch_rank

    if not logger_cfg.enabled or launch_rank()[0] != 0:  # the other ranks of a launch open no store
        return
    from ccexp.tracking.store import check_server, check_sqlite

    store = run_store(logger_cfg.tracking_uri, outputs)
    log.info("%s", store.line())
    check_server(store, default_uri=str((outputs / "mlflow.db").resolve()))
    if store.uri.startswith("sqlite:///"):
        check_sqlite(Path(store.uri[len("sqlite:///"):]), write=True)


def slurm_job_id() -> str | None:
    """The Slurm job this process runs in, as squeue and scancel name it (``<array job>_<task>`` for a task of
    a job array, as ``hydra/launcher=slurm`` submits a sweep), or None outside Slurm."""
    env = os.environ
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def flatten(cfg: Any, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into ``a.b.c -> str(value)`` params (MLflow's 6,000-char value limit)."""
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    out: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            out[key] = str(node)[:6000]

    walk(container, prefix)
    return out


def shown(value: float) -> float:
    """``value`` to 6 significant digits (244.801 for 244.80123456; a count stays exact): the MLflow UI shows
    a metric with all its digits and has no display precision (mlflow/mlflow#17150), and no held-out figure
    is known to 1e-6 of itself."""
    value = float(value)
    return value if value.is_integer() or not math.isfinite(value) else float(f"{value:.6g}")


class RunRecord:
    """The MLflow run of one ccexp run, owned end to end through MLflow's public client: created with
    the flattened config as params (nested under the sweep's parent run in a multirun; in a Slurm job
    tagged ``slurm_job_id``, as squeue names the job), handed to
    Lightning as its logger, given the stages' figures and the results, and closed — FINISHED;
    KILLED when a signal stops the ``with`` block; FAILED when anything else raises there. It also
    writes ``run.json`` (the run's name and MLflow id) into the run folder, which
    ``train.resume_from=last`` uses to find the run's checkpoints. A run resumed from a checkpoint of
    an interrupted run of the same configuration continues that MLflow run (``continue_run``: reopened
    RUNNING, its params kept, a ``resumed`` tag counting the resumes) rather than opening a second one of
    the same name. With ``logger.enabled=false`` the MLflow calls are no-ops, and so they are on every rank
    of a torchrun/srun launch but rank 0: those ranks run the same pipeline and train, but neither open
    the MLflow store, nor hand Lightning a logger, nor write ``run.json`` (rank 0 records the run).

    Args:
        cfg: the run's config; outputs: the absolute ``paths.outputs``; run_dir: the run's folder;
            tags: run tags besides the sampler, model, data, recipe and run folder; resume: what
            [`ccexp.launch.resume.find_resume`][ccexp.launch.resume.find_resume] decided: the run's identity (its
            name and full config digest, tagged ``config_digest``), the MLflow run of the checkpoint being resumed
            (continued), and the dead earlier runs whose MLflow runs are ended
            ([`ccexp.launch.resume.end_dead_runs`][ccexp.launch.resume.end_dead_runs]).
    """

    def __init__(self, cfg: DictConfig, outputs: Path, run_dir: Path | None = None, tags: dict[str, str] | None = None,
                 resume=None):
        identity = resume.identity if resume is not None and resume.identity is not None else run_identity(cfg)
        continue_run = resume.run_id if resume is not None else None
        self.cfg, self.name, self.digest, self.run_dir = cfg, identity.name, identity.digest, run_dir
        self.logger = None  # Lightning's MLFlowLogger, or None when disabled
        self._extra: list | None = None  # the loggers of logger.loggers (see loggers)
        self.continued: dict | None = None  # the interrupted run this one continues: its params and tags
        from ccexp.embedding.shards import launch_rank

        self.rank_zero = launch_rank()[0] == 0  # the other ranks of a launch record nothing
        if not cfg.logger.enabled or not self.rank_zero:
            return
        from lightning.fabric.utilities.rank_zero import rank_zero_only
        from lightning.pytorch.loggers import MLFlowLogger

        from ccexp.tracking.server import LOCAL_STORE, FallbackClient, client_for, start_run

        self.store = run_store(cfg.logger.tracking_uri, outputs)
        self.uri = self.store.uri
        # artifacts: logger.artifact_location, else <outputs>/mlartifacts for a local store, else where the server says
        artifacts = cfg.logger.artifact_location or (None if self.store.is_server else outputs / "mlartifacts")
        os.environ.pop("MLFLOW_RUN_ID", None)  # a stale id in the environment would hijack the run
        # where the run's writes go while a tracking server is away
        self.local_store = (run_dir if run_dir is not None else outputs / LOCAL_STORE / self.name) / LOCAL_STORE
        self.client = client_for(self.store, self.local_store)
        if rank_zero_only.rank != 0:  # only rank 0 logs (Lightning's logger is inert on the others)
            self.logger = MLFlowLogger(experiment_name=cfg.logger.experiment, tracking_uri=self.uri, log_model=False)
            return
        if resume is not None and resume.dead:
            from ccexp.launch.resume import end_dead_runs

            end_dead_runs(self.client, resume.dead)
        tags = {"sampler": cfg.sampler.name, "model": cfg.model.name, "data": cfg.data.name, "config_digest": self.digest,
                "recipe": cfg.recipe_name or "none", **({"run_dir": str(run_dir)} if run_dir else {}),
                **({"slurm_job_id": slurm_job_id()} if slurm_job_id() else {}), **(tags or {})}
        if os.environ.get(PARENT_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_ENV]
        previous = self._continuable(continue_run)
        if previous is not None:
            self.continued = {"params": dict(previous.data.params), "resumed": int(previous.data.tags.get("resumed", 0))}
            if isinstance(self.client, FallbackClient):
                self.client.adopt(continue_run, cfg.logger.experiment, self.name)
            self.client.update_run(continue_run, status="RUNNING")
            for key, value in tags.items():
                self.client.set_tag(continue_run, key, value)
            run_id = continue_run
        else:
            from mlflow.tracking.context.registry import resolve_tags

            run_id = start_run(self.client, cfg.logger.experiment, self.name, resolve_tags(tags), artifacts,
                               local=not self.store.is_server)  # resolve_tags: the user, source, git commit
        self.logger = MLFlowLogger(experiment_name=cfg.logger.experiment, run_name=self.name, tracking_uri=self.uri,
                                   log_model=False, run_id=run_id)
        self.logger._mlflow_client = self.client  # Lightning writes through ccexp's client (it takes no argument for it)

    def _continuable(self, run_id: str | None):
        """The MLflow run ``run_id`` when this run continues it: it exists in this experiment, holds this configuration
        (its ``config_digest`` tag) and did not finish; else None (a new run is opened; also when the store cannot tell
        now)."""
        if run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
            exp = self.client.get_experiment_by_name(self.cfg.logger.experiment)
        except MlflowException:
            return None
        same = run.data.tags.get("config_digest") == self.digest if run.data.tags.get("config_digest") else \
            run.info.run_name == self.name  # a run from before ccexp tagged its configuration: its name
        if exp is None or run.info.experiment_id != exp.experiment_id or not same or run.info.status == "FINISHED":
            return None
        return run

    def __enter__(self) -> "RunRecord":
        """Open the run: its params, the extra loggers started, ``run.json`` running. Whatever fails here ends what
        it began as ``__exit__`` would (the MLflow run FAILED, run.json ``failed``), and an extra logger that cannot
        start is one line naming it."""
        try:
            return self._open()
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise

    def _open(self) -> "RunRecord":
        run_id = None
        if self.logger is not None:
            params = flatten(self.cfg)
            if self.continued is not None:  # MLflow keeps a param's first value: log only the new ones
                old = self.continued["params"]
                changed = sorted(k for k in params if k in old and old[k] != params[k])
                params = {k: v for k, v in params.items() if k not in old}
                self.client.set_tag(self.logger.run_id, "resumed", str(self.continued["resumed"] + 1))
                if changed:
                    self.client.set_tag(self.logger.run_id, "resumed_with", "; ".join(
                        f"{k}={flatten(self.cfg)[k]}" for k in changed)[:5000])
            self.logger.log_hyperparams(params)
            run_id = self.logger.run_id
        extras = sorted(k for k, v in (self.cfg.logger.get("loggers") or {}).items() if v is not None)
        for key, logger in zip(extras, self.loggers[1 if self.logger is not None else 0:]):
            try:  # TensorBoard's hparams, W&B's config
                if type(logger).__name__ == "TensorBoardLogger":
                    from ccexp.training.extras import start_tensorboard

                    start_tensorboard(logger, flatten(self.cfg))
                else:
                    logger.log_hyperparams(flatten(self.cfg))
            except Exception as e:  # noqa: BLE001 (each library's own: the line names the logger)
                line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
                raise CcexpError(f"logger.loggers.{key} could not start ({type(e).__name__}: {line}); the MLflow run "
                                 "is ended FAILED") from None
        if self.logger is not None:
            log.info("mlflow: run %r (%s) in %s%s", self.name, run_id, self.uri,
                     ", continued from where it was interrupted" if self.continued is not None else "")
        if self.run_dir is not None and self.rank_zero:
            from ccexp.launch.resume import write_run_json

            write_run_json(self.run_dir, run_name=self.name, mlflow_run_id=run_id, slurm_job_id=slurm_job_id(),
                           status="running", steps=int(self.cfg.train.steps), config_digest=self.digest)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and self.run_dir is not None and self.rank_zero:
            from ccexp.errors import Interrupted, StoppedEarly
            from ccexp.launch.resume import write_run_json

            stopped = issubclass(exc_type, (Interrupted, SystemExit, StoppedEarly))
            step = getattr(exc, "step", None)
            write_run_json(self.run_dir, status="stopped" if stopped else "failed",
                           **({"step": int(step)} if step is not None else {}))
        if exc_type is not None and self.logger is not None and self.logger.run_id is not None:
            from ccexp.errors import Interrupted, StoppedEarly

            # Lightning marks the run FINISHED or FAILED after fit; what happened afterwards must show. A signal
            # (Interrupted), an exit asked for while the run was open (submitit requeueing a Slurm job on
            # SIGUSR2 outside training, Lightning's SIGTERMException), or a callback's early stop (StoppedEarly) is
            # KILLED: the run was stopped, not broken, and a resume continues it
            stopped = issubclass(exc_type, (Interrupted, SystemExit, StoppedEarly))
            if issubclass(exc_type, StoppedEarly):
                self.client.set_tag(self.logger.run_id, "incomplete", f"step {exc.step} of {exc.steps}")
            self.client.set_terminated(self.logger.run_id, "KILLED" if stopped else "FAILED")
            if exc is not None and not stopped:
                self.client.set_tag(self.logger.run_id, "error", str(exc).splitlines()[0][:5000] if str(exc) else
                                    exc_type.__name__)
        if exc_type is not None and self._extra:
            self._close_extras("failed")
        self.close()
        return False

    def close(self) -> None:
        """On a tracking server: deliver what a server away left in the local store (one line when it cannot),
        and record in ``run.json`` the id the run has on the server (a run begun while it was away has one
        only once delivered)."""
        from ccexp.tracking.server import FallbackClient

        if self.logger is None or not isinstance(self.client, FallbackClient) or self.logger.run_id is None:
            return
        self.client.close()
        server_id = self.client.server_run_id(self.logger.run_id)
        if self.run_dir is not None and server_id not in (None, self.logger.run_id):
            from ccexp.launch.resume import write_run_json

            write_run_json(self.run_dir, run_name=self.name, mlflow_run_id=server_id)

    def set_tag(self, key: str, value: str) -> None:
        if self.logger is not None:
            self.client.set_tag(self.logger.run_id, key, value[:5000])

    @property
    def loggers(self) -> list:
        """The Lightning loggers of the run: MLflow's (when enabled), then those of ``logger.loggers``
        (TensorBoard, ...), built once from their ``_target_``; none on the other ranks of a launch."""
        if self._extra is None:
            from ccexp.training.extras import build_loggers

            self._extra = build_loggers(self.cfg.logger.get("loggers"), self.name) if self.rank_zero else []
        return [x for x in (self.logger, *self._extra) if x is not None]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics (names made MLflow-safe by [`metric_keys`][ccexp.names.metric_keys]) at ``step`` to every logger, each
        fraction to 6 significant digits ([`shown`][ccexp.tracking.mlflow_run.shown])."""
        for logger in self.loggers:
            logger.log_metrics({k: shown(v) for k, v in metric_keys(metrics).items()}, step=step)

    def log_artifacts(self, paths: list[Path], artifact_dir: str | None = None) -> None:
        """Copy ``paths`` into the MLflow run's ``artifact_dir``; the tables (``artifact_dir="tables"``, CSV)
        also go to every logger of ``logger.loggers`` that takes tables (W&B's ``log_table``) as
        ``tables/<name>``."""
        if self.logger is not None:
            for path in paths:
                self.client.log_artifact(self.logger.run_id, str(path), artifact_dir)
        takers = [x for x in self.loggers if x is not self.logger and hasattr(x, "log_table")]
        if artifact_dir == "tables" and takers:
            import pandas as pd

            for path in (p for p in paths if p.suffix == ".csv"):
                frame = pd.read_csv(path)
                for logger in takers:
                    logger.log_table(key=f"tables/{path.stem}", dataframe=frame)

    def log_stages(self, results: dict, cluster_report: tuple[dict[str, float], list[Path]], step: int,
                   curation_report: list[Path] | None = None) -> None:
        """The cached stages' times (``time/<stage>_seconds``), reuse (``cache/<stage>_reused``) and
        fingerprints (a tag), the cluster report (``cluster/*`` metrics, ``clusters/`` files, also copied
        into the run folder's ``clusters/``) and the dedup stage's (``dedup/removed``,
        ``dedup/removed_fraction``, ``dedup/`` files)."""
        if self.run_dir is not None and cluster_report[1]:
            import shutil

            (self.run_dir / "clusters").mkdir(parents=True, exist_ok=True)
            for path in cluster_report[1]:
                (shutil.copytree if path.is_dir() else shutil.copy2)(path, self.run_dir / "clusters" / path.name)
            log.info("cluster: the cluster report (sizes, nearest documents, label agreement) is in %s",
                     self.run_dir / "clusters")
        if self.logger is None:
            return
        metrics = {f"time/{name}_seconds": r.seconds for name, r in results.items()}
        metrics.update({f"cache/{name}_reused": float(r.reused) for name, r in results.items()})
        metrics.update({f"cluster/{k}": v for k, v in cluster_report[0].items()})
        embed = results["embed"].figures if "embed" in results else {}
        if "long_documents" in embed:
            metrics["embed/long_documents"] = float(embed["long_documents"])
            metrics["embed/truncated_documents"] = float(embed["long_documents"]) if \
                embed.get("long_documents_mode") == "truncate" else 0.0
        if "dedup" in results:
            metrics.update({f"dedup/{k}": float(results["dedup"].figures[k]) for k in ("removed", "removed_fraction")})
        self.log_metrics(metrics, step)
        self.log_artifacts(cluster_report[1], "clusters")
        self.log_artifacts(curation_report or [], "dedup")
        self.client.set_tag(self.logger.run_id, "fingerprints",
                            ",".join(f"{name}={r.fingerprint}" for name, r in results.items()))

    def _close_extras(self, status: str) -> None:
        """Flush and close the loggers of ``logger.loggers`` once (TensorBoard's files; a W&B run is finished,
        so that the next run of a sweep in this process opens its own rather than continuing this one)."""
        from ccexp.tracking.loggers import close_logger

        for logger in self.loggers[1 if self.logger is not None else 0:]:
            close_logger(logger, status)
        self._extra = []

    def finish(self, tags: dict[str, str] | None = None, step: int | None = None,
               metrics: dict[str, float] | None = None, fingerprints: dict[str, str] | None = None) -> None:
        """Set ``tags`` on the run and mark it FINISHED; its ``run.json`` says ``finished`` at ``step`` with those
        of ``metrics`` named in [`RUN_JSON_METRICS`][ccexp.launch.resume.RUN_JSON_METRICS] (what a later run of
        the same configuration reports instead of training again) and the stages' ``fingerprints`` (a later run
        on another corpus is not this one)."""
        for key, value in (tags or {}).items():
            self.set_tag(key, value)
        if self.run_dir is not None and self.rank_zero:
            from ccexp.launch.resume import RUN_JSON_METRICS, write_run_json

            write_run_json(self.run_dir, status="finished", **({"step": int(step)} if step is not None else {}),
                           metrics={k: float(v) for k, v in (metrics or {}).items() if k in RUN_JSON_METRICS},
                           **({"fingerprints": dict(fingerprints)} if fingerprints else {}))
        self._close_extras("success")
        if self.logger is not None:
            self.client.set_terminated(self.logger.run_id, "FINISHED")


