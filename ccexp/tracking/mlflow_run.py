"""MLflow tracking on a SQLite store (never the deprecated file store), owned by one :class:`RunRecord`.

The store is ``<outputs>/mlflow.db`` and artifacts go to ``<outputs>/mlartifacts`` by default, both
absolute, so runs launched from any folder land in one place and compare in one UI
(``mlflow ui --backend-store-uri sqlite:///<outputs>/mlflow.db``).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ccexp.names import metric_keys, run_name

log = logging.getLogger("ccexp")
PARENT_ENV = "CCEXP_PARENT_RUN_ID"  # set by a sweep's parent run (ccexp.tracking.sweep) for its jobs


def tracking_uri(uri: str | None, outputs: Path) -> str:
    """``None``/empty -> ``sqlite:///<outputs>/mlflow.db``; a relative sqlite path is made absolute."""
    if not uri:
        return f"sqlite:///{(outputs / 'mlflow.db').resolve()}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    return uri


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


def open_store(uri: str):
    """An ``MlflowClient`` on ``uri``. A SQLite store is created and migrated under a file lock next to
    it, so runs that start together on a fresh ``paths.outputs`` do not race on its schema. A store this
    call could not finish creating (a full disk) is removed, so none is left half-created; one left
    half-created earlier (its schema migration cut short) is set aside and created anew when it holds
    no run, or named in one line when it does.

    Raises:
        CcexpError: for a full disk, or a half-created store that holds runs.
    """
    from filelock import FileLock
    from mlflow import MlflowClient

    from ccexp.errors import CcexpError, disk_full_line

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # schema creation chatter
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".lock"):
        for attempt in (1, 2):
            existed = db.is_file()
            try:
                client = MlflowClient(uri)
                client.search_experiments(max_results=1)  # opens the store: creates or migrates its tables here
                return client
            except Exception as e:
                line = disk_full_line(e, db.parent)
                if not existed:  # this call's own half-made store: gone, so nothing looks complete
                    for f in (db, Path(f"{db}-journal"), Path(f"{db}-wal"), Path(f"{db}-shm")):
                        f.unlink(missing_ok=True)
                if line is not None:
                    raise CcexpError(line.replace("the disk holding", "the disk holding the MLflow store in", 1)
                                     ) from None
                if not existed or attempt == 2:
                    raise
                runs = _runs_in(db)
                if runs:
                    raise CcexpError(f"the MLflow store {db} cannot be opened ({str(e).splitlines()[0][:200]}) and "
                                     f"holds {runs} run(s); restore it from a copy, or set logger.tracking_uri to a "
                                     "new store") from None
                aside = db.with_name(f"{db.name}.half-created-{time.strftime('%Y%m%d-%H%M%S')}")
                _forget_engine(uri)  # MLflow keeps one engine per URI, still open on the file set aside
                os.replace(db, aside)
                log.warning("mlflow: the store %s was left half-created (%s) and held no run: set aside as %s and "
                            "created anew", db, str(e).splitlines()[0][:160], aside.name)
    raise AssertionError("unreachable")


def _forget_engine(uri: str) -> None:
    """Close and drop the SQLAlchemy engine MLflow's store class keeps for ``uri`` (its ``_engine_map``), so
    the next client opens the file that is there now."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(uri, None)
    if engine is not None:
        engine.dispose()


def _runs_in(db: Path) -> int:
    """Runs in a SQLite MLflow store read directly (0 when its tables cannot be read)."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return int(con.execute("select count(*) from runs").fetchone()[0])
    except sqlite3.Error:
        return 0


def ensure_experiment(client, name: str, artifact_location: str | Path) -> str:
    """The id of experiment ``name``, created with an explicit artifact folder if it does not exist.

    A new experiment is tagged a classic ML experiment (``mlflow.experimentKind =
    custom_model_development``), so MLflow 3's UI opens it on the runs table rather than its GenAI
    traces view, and the store's empty ``Default`` experiment is removed so it does not sit beside it.
    """
    from mlflow.exceptions import MlflowException

    artifacts = Path(artifact_location).resolve()
    artifacts.mkdir(parents=True, exist_ok=True)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        experiment_id = client.create_experiment(name, artifact_location=artifacts.as_uri(),
                                                 tags={"mlflow.experimentKind": "custom_model_development"})
    except MlflowException:  # another run created it in the meantime
        return client.get_experiment_by_name(name).experiment_id
    default = client.get_experiment_by_name("Default")
    if default is not None and default.lifecycle_stage == "active" and \
            not client.search_runs([default.experiment_id], max_results=1):
        client.delete_experiment(default.experiment_id)
    return experiment_id


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
            tags: run tags besides the sampler, model, data, recipe and run folder; continue_run: the MLflow
            run id of the checkpoint being resumed, if any.
    """

    def __init__(self, cfg: DictConfig, outputs: Path, run_dir: Path | None = None, tags: dict[str, str] | None = None,
                 continue_run: str | None = None):
        self.cfg, self.name, self.run_dir = cfg, run_name(cfg), run_dir
        self.logger = None  # Lightning's MLFlowLogger, or None when disabled
        self._extra: list | None = None  # the loggers of logger.loggers (see loggers)
        self.continued: dict | None = None  # the interrupted run this one continues: its params and tags
        from ccexp.embedding.shards import launch_rank

        self.rank_zero = launch_rank()[0] == 0  # the other ranks of a launch record nothing
        if not cfg.logger.enabled or not self.rank_zero:
            return
        from lightning.pytorch.loggers import MLFlowLogger

        self.uri = tracking_uri(cfg.logger.tracking_uri, outputs)
        artifacts = Path(cfg.logger.artifact_location or outputs / "mlartifacts").resolve()
        os.environ.pop("MLFLOW_RUN_ID", None)  # a stale id in the environment would hijack the run
        self.client = open_store(self.uri)
        ensure_experiment(self.client, cfg.logger.experiment, artifacts)
        tags = {"sampler": cfg.sampler.name, "model": cfg.model.name, "data": cfg.data.name,
                "recipe": cfg.recipe_name or "none", **({"run_dir": str(run_dir)} if run_dir else {}),
                **({"slurm_job_id": slurm_job_id()} if slurm_job_id() else {}), **(tags or {})}
        if os.environ.get(PARENT_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_ENV]
        previous = self._continuable(continue_run)
        if previous is not None:
            self.continued = {"params": dict(previous.data.params), "resumed": int(previous.data.tags.get("resumed", 0))}
            self.client.update_run(continue_run, status="RUNNING")
            for key, value in tags.items():
                self.client.set_tag(continue_run, key, value)
        self.logger = MLFlowLogger(experiment_name=cfg.logger.experiment, run_name=self.name, tracking_uri=self.uri,
                                   artifact_location=artifacts.as_uri(), tags=None if previous else tags,
                                   log_model=False, run_id=continue_run if previous else None)

    def _continuable(self, run_id: str | None):
        """The MLflow run ``run_id`` when this run continues it: it exists in this experiment under this name
        and did not finish; else None (a new run is opened)."""
        if run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        exp = self.client.get_experiment_by_name(self.cfg.logger.experiment)
        if exp is None or run.info.experiment_id != exp.experiment_id or run.info.run_name != self.name \
                or run.info.status == "FINISHED":
            return None
        return run

    def __enter__(self) -> "RunRecord":
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
            log.info("mlflow: run %r (%s) in %s%s", self.name, run_id, self.uri,
                     ", continued from where it was interrupted" if self.continued is not None else "")
        if self.run_dir is not None and self.rank_zero:
            import json

            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "run.json").write_text(json.dumps({"run_name": self.name, "mlflow_run_id": run_id,
                                                               "slurm_job_id": slurm_job_id()}))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and self.logger is not None:
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
        return False

    def set_tag(self, key: str, value: str) -> None:
        if self.logger is not None:
            self.client.set_tag(self.logger.run_id, key, value[:5000])

    @property
    def loggers(self) -> list:
        """The Lightning loggers of the run: MLflow's (when enabled), then those of ``logger.loggers``
        (TensorBoard, ...), built once from their ``_target_``; none on the other ranks of a launch."""
        if self._extra is None:
            from ccexp.training.extras import build_loggers

            self._extra = build_loggers(self.cfg.logger.get("loggers")) if self.rank_zero else []
        return [x for x in (self.logger, *self._extra) if x is not None]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics (names made MLflow-safe by :func:`metric_keys`) at ``step`` to every logger."""
        for logger in self.loggers:
            logger.log_metrics(metric_keys(metrics), step=step)

    def log_artifacts(self, paths: list[Path], artifact_dir: str | None = None) -> None:
        if self.logger is not None:
            for path in paths:
                self.client.log_artifact(self.logger.run_id, str(path), artifact_dir)

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

    def finish(self, tags: dict[str, str] | None = None) -> None:
        """Set ``tags`` on the run and mark it FINISHED."""
        for key, value in (tags or {}).items():
            self.set_tag(key, value)
        for logger in self.loggers[1 if self.logger is not None else 0:]:  # flush and close TensorBoard's files
            logger.finalize("success")
        if self.logger is not None:
            self.client.set_terminated(self.logger.run_id, "FINISHED")


