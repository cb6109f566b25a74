"""MLflow tracking on a SQLite store (never the deprecated file store), owned by one :class:`RunRecord`.

The store is ``<outputs>/mlflow.db`` and artifacts go to ``<outputs>/mlartifacts`` by default, both
absolute, so runs launched from any folder land in one place and compare in one UI
(``mlflow ui --backend-store-uri sqlite:///<outputs>/mlflow.db``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("ccexp")
PARENT_ENV = "CCEXP_PARENT_RUN_ID"  # set by a sweep's parent run (ccexp.tracking.sweep) for its jobs


def tracking_uri(uri: str | None, outputs: Path) -> str:
    """``None``/empty -> ``sqlite:///<outputs>/mlflow.db``; a relative sqlite path is made absolute."""
    if not uri:
        return f"sqlite:///{(outputs / 'mlflow.db').resolve()}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    return uri


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


def run_name(cfg: DictConfig) -> str:
    """A readable run name that starts with what usually differs inside a sweep,
    ``<sampler>-k<K>[l<level>]-s<seed>-<config hash>`` (the corpus, model and recipe are run tags),
    never MLflow's random one. The 4-hex-digit hash of the resolved config (paths and
    ``train.resume_from`` excluded) tells apart runs that differ in any other setting; reruns of one
    config share it."""
    import hashlib
    import json

    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("paths", None)
    container.get("train", {}).pop("resume_from", None)
    digest = hashlib.sha256(json.dumps(container, sort_keys=True, default=str).encode()).hexdigest()[:4]
    from ccexp.preflight import cluster_count

    level = f"l{cfg.sampler.level}" if cfg.sampler.level else ""
    groups = (f"by-{cfg.clusterer.label_field}" if "label_field" in cfg.clusterer else f"k{cluster_count(cfg)}{level}")
    return f"{cfg.sampler.name}-{groups}-s{cfg.seed}-{digest}"


def open_store(uri: str):
    """An ``MlflowClient`` on ``uri``. A SQLite store is created and migrated under a file lock next to
    it, so runs that start together on a fresh ``paths.outputs`` do not race on its schema."""
    from filelock import FileLock
    from mlflow import MlflowClient

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # schema creation chatter
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".lock"):
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # opens the store: creates or migrates its tables here
    return client


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
    the flattened config as params (nested under the sweep's parent run in a multirun), handed to
    Lightning as its logger, given the stages' figures and the results, and closed — FINISHED;
    KILLED when a signal stops the ``with`` block; FAILED when anything else raises there. It also
    writes ``run.json`` (the run's name and MLflow id) into the run folder, which
    ``train.resume_from=last`` uses to find the run's checkpoints. With ``logger.enabled=false``
    the MLflow calls are no-ops.

    Args:
        cfg: the run's config; outputs: the absolute ``paths.outputs``; run_dir: the run's folder;
            tags: extra run tags.
    """

    def __init__(self, cfg: DictConfig, outputs: Path, run_dir: Path | None = None, tags: dict[str, str] | None = None):
        self.cfg, self.name, self.run_dir = cfg, run_name(cfg), run_dir
        self.logger = None  # Lightning's MLFlowLogger, or None when disabled
        if not cfg.logger.enabled:
            return
        from lightning.pytorch.loggers import MLFlowLogger

        self.uri = tracking_uri(cfg.logger.tracking_uri, outputs)
        artifacts = Path(cfg.logger.artifact_location or outputs / "mlartifacts").resolve()
        os.environ.pop("MLFLOW_RUN_ID", None)  # a stale id in the environment would hijack the run
        self.client = open_store(self.uri)
        ensure_experiment(self.client, cfg.logger.experiment, artifacts)
        tags = dict(tags or {})
        if os.environ.get(PARENT_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_ENV]
        self.logger = MLFlowLogger(experiment_name=cfg.logger.experiment, run_name=self.name, tracking_uri=self.uri,
                                   artifact_location=artifacts.as_uri(), tags=tags, log_model=False)

    def __enter__(self) -> "RunRecord":
        run_id = None
        if self.logger is not None:
            self.logger.log_hyperparams(flatten(self.cfg))
            run_id = self.logger.run_id
            log.info("mlflow: run %r (%s) in %s", self.name, run_id, self.uri)
        if self.run_dir is not None:
            import json

            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "run.json").write_text(json.dumps({"run_name": self.name, "mlflow_run_id": run_id}))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and self.logger is not None:
            from ccexp.errors import Interrupted

            # Lightning marks the run FINISHED or FAILED after fit; what happened afterwards must show
            self.client.set_terminated(self.logger.run_id, "KILLED" if issubclass(exc_type, Interrupted) else "FAILED")
            if exc is not None and not issubclass(exc_type, Interrupted):
                self.client.set_tag(self.logger.run_id, "error", str(exc).splitlines()[0][:5000] if str(exc) else
                                    exc_type.__name__)
        return False

    def resume_checkpoint(self, resume_from: str | None, outputs: Path) -> str | None:
        """``train.resume_from`` as a path: ``last`` is the newest checkpoint of an earlier run of this
        same configuration (same run name) under ``outputs``; ``auto`` is the same, or None (a fresh
        start) when there is none — for jobs a scheduler may requeue.

        Raises:
            CcexpError: for ``last`` when no such checkpoint exists.
        """
        if resume_from not in ("last", "auto"):
            return resume_from
        import json

        from ccexp.errors import CcexpError

        found = [ckpt for meta in outputs.glob("*runs/**/run.json") if meta.parent != self.run_dir
                 and json.loads(meta.read_text()).get("run_name") == self.name
                 for ckpt in (meta.parent / "checkpoints").glob("*.ckpt")]
        if not found and resume_from == "auto":
            log.info("resume: train.resume_from=auto found no earlier checkpoint of %s; starting fresh", self.name)
            return None
        if not found:
            raise CcexpError(f"train.resume_from=last: no checkpoint of an earlier run named {self.name} under "
                             f"{outputs}; give a checkpoint path, or run without train.resume_from")
        newest = max(found, key=lambda p: p.stat().st_mtime)
        log.info("resume: train.resume_from=last is %s", newest)
        return str(newest)

    def set_tag(self, key: str, value: str) -> None:
        if self.logger is not None:
            self.client.set_tag(self.logger.run_id, key, value[:5000])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics (names made MLflow-safe by :func:`metric_keys`) at ``step``."""
        if self.logger is not None:
            self.logger.log_metrics(metric_keys(metrics), step=step)

    def log_artifacts(self, paths: list[Path], artifact_dir: str | None = None) -> None:
        if self.logger is not None:
            for path in paths:
                self.client.log_artifact(self.logger.run_id, str(path), artifact_dir)

    def log_stages(self, results: dict, cluster_report: tuple[dict[str, float], list[Path]], step: int,
                   curation_report: list[Path] | None = None) -> None:
        """The cached stages' times (``time/<stage>_seconds``), reuse (``cache/<stage>_reused``) and
        fingerprints (a tag), the cluster report (``cluster/*`` metrics, ``clusters/`` files) and the
        dedup stage's (``dedup/removed``, ``dedup/removed_fraction``, ``dedup/`` files)."""
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

    def finish(self) -> None:
        if self.logger is not None:
            self.client.set_terminated(self.logger.run_id, "FINISHED")


def metric_keys(metrics: dict[str, float]) -> dict[str, float]:
    """Make metric names MLflow-safe, part by part between the ``/``: characters outside
    ``[A-Za-z0-9_.- ]`` become ``_``, an empty or dot-only part becomes ``_empty_`` (MLflow refuses
    ``//`` and ``..``), and names that collide after that get a short hash of the original."""
    import hashlib
    import re

    out: dict[str, float] = {}
    for name, value in metrics.items():
        parts = [re.sub(r"[^A-Za-z0-9_.\- ]", "_", part).strip() for part in name.split("/")]
        safe = "/".join(p if p.strip(".") else "_empty_" for p in parts)
        if safe != name and (safe in out or safe in metrics):
            safe = f"{safe}_{hashlib.sha256(name.encode()).hexdigest()[:6]}"
        out[safe] = value
    return out
