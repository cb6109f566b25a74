"""Runs on a team's MLflow tracking server that outlive the server going away.

Every write of a run goes through [`FallbackClient`][ccexp.tracking.server.FallbackClient]. MLflow itself retries a call that fails
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``_BACKOFF_FACTOR``, ``_TIMEOUT``: a 5xx or a timeout on one call
costs a retry, nothing more). A call that still fails because the server cannot be reached
([`ccexp.tracking.store.unreachable`][ccexp.tracking.store.unreachable]) sends the run to a local SQLite store (``<run folder>/mlflow-local``,
one line saying so) and training goes on; a background thread asks the server every ``probe_every_s``
seconds whether it is back, and the next write after it is delivers what the local store holds into the
same server run (metrics with their steps and timestamps, params, tags, artifacts, the run's end) and goes
back to the server. A run that ends while the server is still away says, in one line, where its data is
and the command that delivers it later: ``python -m ccexp.deliver <store>`` ([`deliver_store`][ccexp.tracking.server.deliver_store]).
MLflow has no mechanism of its own for this (its ``migrate-filestore`` only turns a file store into
SQLite, and the export-import tools copy a run into a *new* run), so the local store records, per run,
the server and the run it stands for.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from ccexp.errors import CcexpError
from ccexp.tracking.store import Store, check_server, check_sqlite, ensure_experiment, open_store, unreachable

log = logging.getLogger("ccexp")

SERVER_URI = "ccexp.server_uri"  # tags of a run in a local fallback store: the server it belongs to,
SERVER_RUN = "ccexp.server_run_id"  # its id there (absent while it was never created there),
SERVER_EXPERIMENT = "ccexp.server_experiment"  # the experiment's name there,
DELIVERED = "ccexp.delivered"  # and when everything it holds was delivered
_RESERVED = {SERVER_URI, SERVER_RUN, SERVER_EXPERIMENT, DELIVERED}
LOCAL_STORE = "mlflow-local"  # the fallback store's folder, in the run (or sweep, or plan) folder


def start_run(client, experiment: str, name: str, tags: dict[str, str], artifact_location, local: bool) -> str:
    """A new run ``name`` of ``experiment`` (created if missing) with ``tags``; its id. Through a
    [`ccexp.tracking.server.FallbackClient`][ccexp.tracking.server.FallbackClient] on a server (so a server away makes a local run)."""
    if isinstance(client, FallbackClient):
        return client.create_run(experiment, name, tags, None if artifact_location is None else
                                 str(artifact_location))
    experiment_id = ensure_experiment(client, experiment, artifact_location, local=local)
    return client.create_run(experiment_id, run_name=name, tags=tags).info.run_id


def client_for(store: Store, local_dir: Path, probe_every_s: float = 30.0):
    """The client a run writes through: a [`FallbackClient`][ccexp.tracking.server.FallbackClient] for a server, MLflow's own client for a
    local store (which cannot go away)."""
    if store.is_server:
        return FallbackClient(store.uri, local_dir, probe_every_s)
    return open_store(store.uri)


class FallbackClient:
    """MLflow's client on a tracking server, whose writes never stop the run.

    Reads go to the server. A write that fails because the server cannot be reached ([`unreachable`][ccexp.tracking.store.unreachable],
    after MLflow's own retries) and every write after it go to the local SQLite store in ``local_dir``,
    into a run there that records which server run it stands for; a background thread asks the server
    every ``probe_every_s`` seconds whether it answers again, and the next write after it does delivers
    the local run into the server run ([`deliver_run`][ccexp.tracking.server.deliver_run]) and goes back to the server. A run created
    while the server is away is created on the server when it is delivered. [`close`][ccexp.tracking.server.FallbackClient.close] tries once
    more, and says in one line what is still in the local store and how to deliver it.

    Args:
        uri: the server's tracking URI; local_dir: the local store's folder (created when first needed);
            probe_every_s: how often to ask whether the server is back.
    """

    def __init__(self, uri: str, local_dir: Path, probe_every_s: float = 30.0):
        from mlflow import MlflowClient

        self.uri, self.local_dir, self.probe_every_s = uri, Path(local_dir), probe_every_s
        self.server = MlflowClient(uri)
        self.away: str | None = None  # why the server is not written to now (None: it is)
        self.delivered = {"metrics": 0, "params": 0, "tags": 0, "artifacts": 0}
        self._local = None
        self._mirror: dict[str, str] = {}  # run id as callers know it -> its run in the local store
        self._server_id: dict[str, str | None] = {}  # run id as callers know it -> its id on the server
        self._runs: dict[str, tuple[str, str]] = {}  # run id -> (experiment name, run name)
        self._back = threading.Event()
        self._lock = threading.RLock()

    # -- the local store ------------------------------------------------------------------------------
    @property
    def local_uri(self) -> str:
        return f"sqlite:///{(self.local_dir / 'mlflow.db').resolve()}"

    def local(self):
        if self._local is None:
            self._local = open_store(self.local_uri)
        return self._local

    def _mirror_of(self, run_id: str) -> str:
        """The local run standing for ``run_id`` (created on first use)."""
        if run_id not in self._mirror:
            experiment, name = self._runs.get(run_id, ("ccexp", run_id))
            local = self.local()
            exp = ensure_experiment(local, experiment, self.local_dir / "artifacts")
            tags = {SERVER_URI: self.uri, SERVER_EXPERIMENT: experiment}
            if self._server_id.get(run_id, run_id):
                tags[SERVER_RUN] = self._server_id.get(run_id, run_id)
            self._mirror[run_id] = local.create_run(exp, run_name=name, tags=tags).info.run_id
        return self._mirror[run_id]

    # -- going away and coming back -------------------------------------------------------------------
    def _went_away(self, why: str, call: str) -> None:
        self.away = why
        self._back.clear()
        log.warning("mlflow: the tracking server %s stopped answering (%s, at %s); the run goes on and logs to the "
                    "local store %s until the server answers again (asked every %g s)", self.uri, why, call,
                    self.local_dir, self.probe_every_s)
        threading.Thread(target=self._probe, name="ccexp-mlflow-probe", daemon=True).start()

    def answers(self) -> bool:
        """One quick question to the server (no retry, 10 s at most): does it answer?"""
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.rest_utils import http_request

        try:
            r = http_request(get_default_host_creds(self.uri), "/api/2.0/mlflow/experiments/search", "GET",
                             params={"max_results": 1}, max_retries=0, timeout=10, raise_on_status=False)
        except Exception:  # noqa: BLE001 (still away)
            return False
        return r.status_code == 200

    def _probe(self) -> None:
        while self.away is not None:
            time.sleep(self.probe_every_s)
            if self.away is not None and self.answers():
                self._back.set()
                return

    def _try_return(self) -> None:
        """Deliver the local runs once the probe says the server is back; stay away if it goes again."""
        if self.away is None or not self._back.is_set():
            return
        try:
            counts = self._deliver_all()
        except Exception as e:  # noqa: BLE001
            why = unreachable(e)
            if why is None:
                raise
            self._back.clear()
            threading.Thread(target=self._probe, name="ccexp-mlflow-probe", daemon=True).start()
            return
        self.away = None
        log.info("mlflow: the tracking server %s answers again: delivered %d metric values, %d params, %d tags and %d "
                 "artifact files that the local store %s kept while it was away", self.uri, counts["metrics"],
                 counts["params"], counts["tags"], counts["artifacts"], self.local_dir)

    def _deliver_all(self) -> dict[str, int]:
        counts = {"metrics": 0, "params": 0, "tags": 0, "artifacts": 0}
        for run_id, mirror in list(self._mirror.items()):
            server_id, done = deliver_run(self.local(), mirror, self.server, self._server_id.get(run_id, run_id),
                                          self.local_dir)
            self._server_id[run_id] = server_id
            del self._mirror[run_id]  # the next absence starts a new local run
            for k in counts:
                counts[k] += done[k]
                self.delivered[k] += done[k]
        return counts

    def server_run_id(self, run_id: str) -> str | None:
        """The id on the server of the run callers know as ``run_id`` (None: not created there yet)."""
        return self._server_id.get(run_id, run_id)

    def _write(self, name: str, run_id: str, *args, **kwargs):
        with self._lock:
            self._try_return()
            if self.away is None:
                try:
                    return getattr(self.server, name)(self.server_run_id(run_id), *args, **kwargs)
                except Exception as e:  # noqa: BLE001
                    why = unreachable(e)
                    if why is None:
                        raise
                    self._went_away(why, name)
            kwargs.pop("synchronous", None)
            return getattr(self.local(), name)(self._mirror_of(run_id), *args, **kwargs)

    # -- MlflowClient's calls that ccexp and Lightning's MLFlowLogger make ----------------------------
    def create_run(self, experiment_name: str, run_name: str, tags: dict[str, str],
                   artifact_location: str | None = None) -> str:
        """A new run of ``experiment_name`` (created if missing, its artifacts where the server puts them
        unless ``artifact_location``); its id (the local run's while the server is away)."""
        with self._lock:
            self._try_return()
            if self.away is None:
                try:
                    exp = ensure_experiment(self.server, experiment_name, artifact_location, local=False)
                    run_id = self.server.create_run(exp, run_name=run_name, tags=tags).info.run_id
                    self._runs[run_id] = (experiment_name, run_name)
                    return run_id
                except Exception as e:  # noqa: BLE001
                    why = unreachable(e)
                    if why is None:
                        raise
                    self._went_away(why, "create_run")
            local = self.local()
            exp = ensure_experiment(local, experiment_name, self.local_dir / "artifacts")
            run_id = local.create_run(exp, run_name=run_name, tags={
                **tags, SERVER_URI: self.uri, SERVER_EXPERIMENT: experiment_name}).info.run_id
            self._runs[run_id] = (experiment_name, run_name)
            self._mirror[run_id] = run_id
            self._server_id[run_id] = None
            return run_id

    def adopt(self, run_id: str, experiment_name: str, run_name: str) -> None:
        """Write to ``run_id``, an existing server run (a resumed run continues it)."""
        self._runs[run_id] = (experiment_name, run_name)

    def get_run(self, run_id: str):
        """The run from the server; while it is away, the local run standing for one this client writes."""
        with self._lock:
            self._try_return()
            server_id = self.server_run_id(run_id)
            if self.away is None and server_id is not None:
                try:
                    return self.server.get_run(server_id)
                except Exception as e:  # noqa: BLE001
                    why = unreachable(e)
                    if why is None or run_id not in self._runs:
                        raise
                    self._went_away(why, "get_run")
            if run_id not in self._runs:
                from mlflow.exceptions import MlflowException

                raise MlflowException(f"the tracking server {self.uri} is away ({self.away}); run {run_id} is not one "
                                      "this run writes")
            return self.local().get_run(self._mirror_of(run_id))

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        return self._write("log_batch", run_id, metrics=list(metrics), params=list(params), tags=list(tags))

    def log_metric(self, run_id, key, value, timestamp=None, step=None, **kwargs):
        from mlflow.entities import Metric

        metric = Metric(key, value, int(time.time() * 1000) if timestamp is None else timestamp, step or 0)
        return self._write("log_batch", run_id, metrics=[metric])

    def log_param(self, run_id, key, value, synchronous=None):
        return self._write("log_param", run_id, key, value)

    def set_tag(self, run_id, key, value, synchronous=None):
        return self._write("set_tag", run_id, key, value)

    def set_terminated(self, run_id, status=None, end_time=None):
        return self._write("set_terminated", run_id, status, end_time)

    def update_run(self, run_id, status=None, name=None):
        return self._write("update_run", run_id, status, name)

    def log_artifact(self, run_id, local_path, artifact_path=None):
        return self._write("log_artifact", run_id, local_path, artifact_path)

    def log_artifacts(self, run_id, local_dir, artifact_path=None):
        return self._write("log_artifacts", run_id, local_dir, artifact_path)

    def __getattr__(self, name: str):  # any other call (a read) goes to the server
        return getattr(self.server, name)

    def close(self, wait_s: float = 0.0) -> str | None:
        """At the run's end: deliver what the local store holds if the server answers (asked once more, and
        for up to ``wait_s`` seconds); else say in one line where it is and how to deliver it. Returns
        that line, or None when nothing is left in the local store."""
        with self._lock:
            if self.away is None:
                return None
            deadline = time.monotonic() + wait_s
            while True:
                if self.answers():
                    self._back.set()
                    self._try_return()
                if self.away is None or time.monotonic() >= deadline:
                    break
                time.sleep(min(self.probe_every_s, 5.0))
            if self.away is None:
                return None
            line = (f"mlflow: the tracking server {self.uri} is still away ({self.away}); what the run logged since it "
                    f"went away is in the local store {self.local_dir}: once the server is back, deliver it with "
                    f"python -m ccexp.deliver {self.local_dir}")
            log.warning("%s", line)
            return line


def _history(client, run_id: str, keys) -> list:
    out = []
    for key in keys:
        out += client.get_metric_history(run_id, key)
    return out


def artifact_root(run, store: Path | None) -> Path:
    """The folder of ``run``'s artifact files in a local store at ``store``: where the run recorded it (an absolute
    ``file://`` URI) or, when the store was moved or copied since (outputs copied off a compute node, a renamed
    folder, another mount), the same place inside the store's folder now (the longest tail of the recorded path that
    exists under ``store``). A recorded root inside ``store`` that does not exist is a run without artifacts.

    Raises:
        CcexpError: when the recorded root is outside ``store``, gone, and found nowhere under it (the run's artifacts
            were not moved with its store): the run is not delivered.
    """
    from mlflow.utils.file_utils import local_file_uri_to_path

    recorded = Path(local_file_uri_to_path(run.info.artifact_uri))
    if recorded.is_dir() or store is None:
        return recorded
    store = store.resolve()
    parts = recorded.parts
    for i in range(1, len(parts)):
        candidate = store.joinpath(*parts[i:])
        if candidate.is_dir():
            return candidate
    if recorded.is_relative_to(store):
        return recorded  # never made: the run logged no artifact
    raise CcexpError(f"the artifacts of run {run.info.run_name} were recorded at {recorded}, which is gone, and are "
                     f"not under the store's folder {store} either (the store was moved without them?); put them "
                     "back there, or deliver from where the run was written; nothing was delivered")


def deliver_run(local, local_id: str, server, server_id: str | None, store: Path | None = None
                ) -> tuple[str, dict[str, int]]:
    """Copy the local run ``local_id`` into the server run ``server_id`` (created first when None, in the
    experiment the local run names): every metric value with its step and timestamp, the params, the tags,
    the artifact files (found where the store is now: [`artifact_root`][ccexp.tracking.server.artifact_root],
    ``store`` the local store's folder), and the run's end when it ended; then tag the local run delivered. Copying
    again is harmless (MLflow keeps one copy of an identical metric value; params and tags are the same).

    Returns:
        (the server run's id, {"metrics", "params", "tags", "artifacts": how many were copied})

    Raises:
        CcexpError: when the run's artifacts cannot be found (before anything is copied).
    """
    from mlflow.entities import Param, RunTag

    run = local.get_run(local_id)
    root = artifact_root(run, store)
    tags = {k: v for k, v in run.data.tags.items() if k not in _RESERVED}
    if server_id is None and run.data.tags.get(SERVER_URI) == server.tracking_uri:
        server_id = run.data.tags.get(SERVER_RUN)  # made there by an earlier try that was cut short
    if server_id is None:
        exp = ensure_experiment(server, run.data.tags.get(SERVER_EXPERIMENT, "ccexp"), None, local=False)
        server_id = server.create_run(exp, run_name=run.info.run_name, tags=tags,
                                      start_time=run.info.start_time).info.run_id
        local.set_tag(local_id, SERVER_URI, server.tracking_uri)
        local.set_tag(local_id, SERVER_RUN, server_id)
    metrics = _history(local, local_id, run.data.metrics)
    params = [Param(k, v) for k, v in run.data.params.items()]
    tag_list = [RunTag(k, v) for k, v in tags.items() if not k.startswith("mlflow.") or k == "mlflow.parentRunId"]
    for i in range(0, len(metrics), 1000):
        server.log_batch(server_id, metrics=metrics[i:i + 1000])
    for i in range(0, len(params), 100):
        server.log_batch(server_id, params=params[i:i + 100])
    for i in range(0, len(tag_list), 100):
        server.log_batch(server_id, tags=tag_list[i:i + 100])
    files = [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    if files:
        server.log_artifacts(server_id, str(root))
    if run.info.status != "RUNNING":
        server.set_terminated(server_id, run.info.status, run.info.end_time)
    local.set_tag(local_id, DELIVERED, time.strftime("%Y-%m-%d %H:%M:%S"))
    return server_id, {"metrics": len(metrics), "params": len(params), "tags": len(tag_list), "artifacts": len(files)}


def deliver_store(folder: Path, uri: str | None = None) -> list[tuple[str, str, dict[str, int], str]]:
    """Deliver every run of the local store in ``folder`` not yet delivered to its server (``uri``, else the
    one each run records): ``[(run name, server run id, counts, server)]``.

    Raises:
        CcexpError: no store there; a server that does not answer, or stops answering (what was not
            delivered stays marked so: running it again goes on).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    db = folder / "mlflow.db"
    if not db.is_file():
        raise CcexpError(f"{folder} holds no local MLflow store (no mlflow.db); give the folder that the run's line "
                         f"names ({LOCAL_STORE} in the run folder)")
    check_sqlite(db, instead="give the folder of a local store that a run wrote")
    local = MlflowClient(f"sqlite:///{db.resolve()}")
    pending = [r for e in local.search_experiments() for r in local.search_runs([e.experiment_id], max_results=50000)
               if DELIVERED not in r.data.tags]
    done = []
    for run in sorted(pending, key=lambda r: r.info.start_time):
        target = uri or run.data.tags.get(SERVER_URI)
        if not target:
            raise CcexpError(f"run {run.info.run_name} in {db} does not name its server; pass --tracking-uri")
        if target.strip().startswith("sqlite:///") and \
                Path(target.strip()[len("sqlite:///"):]).expanduser().resolve() == db.resolve():
            raise CcexpError(f"--tracking-uri {target} is the local store itself ({db}); deliver it to another store")
        check_server(Store(target, "--tracking-uri" if uri else f"the record of run {run.info.run_name}"))
        server = MlflowClient(target)
        server_id = run.data.tags.get(SERVER_RUN) if target == run.data.tags.get(SERVER_URI) else None
        try:
            if server_id is not None:
                try:
                    server.get_run(server_id)
                except MlflowException as e:
                    if unreachable(e) is not None:
                        raise
                    server_id = None  # the server does not have it (another database): a new run there
                    local.delete_tag(run.info.run_id, SERVER_RUN)
            server_id, counts = deliver_run(local, run.info.run_id, server, server_id, folder)
        except Exception as e:  # noqa: BLE001
            why = unreachable(e)
            if why is None:
                raise
            raise CcexpError(f"the MLflow tracking server {target} stopped answering while run {run.info.run_name} was "
                             f"delivered ({why}); nothing is lost: run the same command again once it answers") from None
        done.append((run.info.run_name, server_id, counts, target))
    return done
