"""Which MLflow store a command uses and why, asked before any work; the store helpers every command shares.

**Which store.** As MLflow's own clients decide it: an explicit setting (``logger.tracking_uri``, or
``--tracking-uri`` / ``--store`` of ``ccexp.report`` and ``ccexp.ui``) wins, then ``MLFLOW_TRACKING_URI``,
then ccexp's default, the SQLite store ``<paths.outputs>/mlflow.db`` ([`resolve_store`][ccexp.tracking.store.resolve_store]). Every
command says which in its first lines ([`Store.line`][ccexp.tracking.store.Store.line]).

**Checked first.** A tracking server (an ``http(s)://`` URI) is asked for one experiment before any stage
runs ([`check_server`][ccexp.tracking.store.check_server]): one that does not answer, refuses the credentials or is not an MLflow server
is one line, exit 2. [`unreachable`][ccexp.tracking.store.unreachable] tells an error that says the server cannot be reached from any
other.

A SQLite store is created under a file lock ([`open_store`][ccexp.tracking.store.open_store]); [`ensure_experiment`][ccexp.tracking.store.ensure_experiment] makes the
experiment a run goes to.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")
PROBE_TRIES, PROBE_TIMEOUT_S = 3, 10  # the pre-flight check: 3 tries (0 s, 2 s apart), 10 s each at most


@dataclass(frozen=True)
class Store:
    """The tracking store a command uses: ``uri``; ``source``, the setting it came from
    (``logger.tracking_uri``, ``MLFLOW_TRACKING_URI``, ``--tracking-uri``, ``--store`` or ``default``);
    ``ignored``, an ``MLFLOW_TRACKING_URI`` that a setting overrode ('' if none)."""

    uri: str
    source: str
    ignored: str = ""

    def __post_init__(self) -> None:
        uri = self.uri.strip()  # a pasted URI's spaces; a scheme in capitals is the same scheme
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        object.__setattr__(self, "uri", scheme.lower() + uri[len(scheme):] if scheme else uri)  # a frozen record
        problem = unusable_uri(self.uri)
        if problem is not None:
            setting = {"default": "the default store", "default-cli": "the default store"}.get(self.source, self.source)
            raise CcexpError(f"{setting}={self.uri!r} is not a tracking URI MLflow can use ({problem})")

    @property
    def is_server(self) -> bool:
        return self.uri.startswith(("http://", "https://"))

    @property
    def origin(self) -> str:
        """Where the URI came from, as the store line and the error lines say it."""
        if self.source == "default":
            return "the default, <paths.outputs>/mlflow.db: neither logger.tracking_uri nor MLFLOW_TRACKING_URI is set"
        if self.source == "default-cli":
            return "the default, outputs/mlflow.db: neither --tracking-uri, --store nor MLFLOW_TRACKING_URI is set"
        return f"from {self.source}" + (f"; MLFLOW_TRACKING_URI={self.ignored} is not used" if self.ignored else "")

    def line(self, prefix: str = "mlflow") -> str:
        return f"{prefix}: tracking store {self.uri} ({self.origin})"

    def change(self, default_uri: str | None = None) -> str:
        """How to point the command at another store."""
        if self.source == "MLFLOW_TRACKING_URI":
            return "point MLFLOW_TRACKING_URI at a server that runs" + (
                f" (unset, the run logs to {default_uri})" if default_uri else ", or unset it")
        if self.source == "logger.tracking_uri":
            return "set logger.tracking_uri to a server that runs" + (
                f" (unset, the run logs to {default_uri})" if default_uri else "")
        return "pass the --tracking-uri of a server that runs"


DATABASES = ("postgresql", "mysql", "mssql")  # SQLAlchemy stores (the driver installed by the user), also "+driver"


def unusable_uri(uri: str) -> str | None:
    """Why MLflow cannot use ``uri`` as a tracking store, in a few words with the likely fix, or None when it can: a
    server (``http(s)://host[:port]``), a SQLite file (``sqlite:///path``), a database (``postgresql://`` ...) or
    Databricks. A path or ``file:`` URI is MLflow's file store, which MLflow 3 refuses ("in maintenance mode"), and
    ``host:port`` without its scheme is read as such a path: the likeliest typo of ``http://host:port``."""
    from urllib.parse import urlparse

    text = uri.strip()
    try:
        parsed = urlparse(text)
        parsed.port  # noqa: B018  (a port that is not a number, a bracket left open: ValueError here)
    except ValueError as e:
        return f"not a URL ({e}); e.g. http://127.0.0.1:5000 or http://[::1]:5000"
    scheme = parsed.scheme.lower()
    if scheme in ("http", "https"):
        return None if parsed.netloc else f"{scheme}:// needs a host, e.g. {scheme}://127.0.0.1:5000"
    if scheme == "sqlite":
        return None if text.startswith("sqlite:///") else "a SQLite store is sqlite:/// and a path, e.g. "                                                            "sqlite:///outputs/mlflow.db"
    if scheme.split("+")[0] in DATABASES:
        return _database_driver_problem(text)
    if scheme == "databricks" or text == "databricks":
        return ("a Databricks workspace is not a store ccexp checks or writes offline; give http(s)://host:port or "
                "sqlite:///path")
    host_port = re.fullmatch(r"([A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(\d{1,5})(/.*)?", text)
    if host_port and (not scheme or scheme == host_port.group(1).lower()):
        return f"without a scheme it is read as a file path; did you mean http://{text}?"
    if not scheme or scheme == "file" or len(scheme) == 1:  # a path (a Windows drive letter too) or file:
        return ("a path is MLflow's file store, which MLflow 3 refuses; give a SQLite file as sqlite:///"
                f"{Path(parsed.path or text).expanduser()}.db or a server as http://host:port")
    return (f"the scheme {scheme}:// is not one MLflow stores runs in; use http(s)://host:port, sqlite:///path or a "
            "database URI")


def _database_driver_problem(uri: str) -> str | None:
    """Why a database URI cannot be used here: its driver is not installed (SQLAlchemy imports it when the engine is
    made, which opens no connection); None when it can."""
    try:
        from sqlalchemy import create_engine

        create_engine(uri).dispose()
    except ModuleNotFoundError as e:
        return f"its database driver is not installed (No module named {e.name!r}); pip install it"
    except Exception as e:  # noqa: BLE001 (SQLAlchemy's own: a malformed database URL)
        return f"not a database URL SQLAlchemy reads ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def resolve_store(configured: str | None, default_uri: str, source: str = "logger.tracking_uri") -> Store:
    """The store of a command: ``configured`` (from ``source``) when set, else ``MLFLOW_TRACKING_URI`` when
    set, else ``default_uri``; a relative ``sqlite:///`` path is made absolute (against the working folder,
    where MLflow would open it)."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if configured:
        uri = absolute(configured)
        return Store(uri, source, env if env and absolute(env) != uri else "")
    if env:
        return Store(absolute(env), "MLFLOW_TRACKING_URI")
    return Store(default_uri, "default")


def absolute(uri: str) -> str:
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    return uri


def unreachable(exc: BaseException) -> str | None:
    """Why ``exc`` says the tracking server could not be reached — refused, timed out, or answering 5xx
    to every one of MLflow's retries — in a few words; None for any other error (a request the server
    refused, a bug), which is raised as it is. A server that dies while it answers (a cut chunked body,
    ``IncompleteRead``) has gone away too."""
    import http.client

    import requests
    import urllib3

    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, requests.exceptions.HTTPError):
            status = getattr(e.response, "status_code", None)
            return f"HTTP {status}" if status is not None and status >= 500 else None
        if isinstance(e, requests.exceptions.RetryError):
            found = re.search(r"too many (\d+) error responses", str(e))
            return f"HTTP {found.group(1)} to every try" if found else "no good answer to any try"
        if isinstance(e, requests.exceptions.Timeout) or (
                isinstance(e, requests.exceptions.ConnectionError) and "timed out" in str(e).lower()):
            return "timed out"
        if isinstance(e, (requests.exceptions.ChunkedEncodingError, http.client.IncompleteRead,
                          http.client.RemoteDisconnected, urllib3.exceptions.ProtocolError)):
            return "connection lost"  # the server went away in the middle of its answer
        if isinstance(e, requests.exceptions.ConnectionError):
            text = str(e).lower()
            return ("connection refused" if "refused" in text else "host not found" if "resolve" in text or
                    "name or service" in text else "connection lost" if "aborted" in text or "reset" in text
                    else "cannot connect")
        e = e.__cause__ or e.__context__
    return None


def check_server(store: Store, default_uri: str | None = None) -> None:
    """Ask the server of ``store`` for one experiment (3 tries, 10 s each at most, whatever MLflow's retry
    settings), so a server that is down is known before any work.

    Raises:
        CcexpError: one line for a server that does not answer, refuses the credentials, or is not an
            MLflow tracking server.
    """
    if not store.is_server:
        return
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    head = f"the MLflow tracking server {store.uri} ({store.origin})"
    started = time.monotonic()
    pool = logging.getLogger("urllib3.connectionpool")
    level = pool.level
    pool.setLevel(logging.ERROR)  # its "Retrying ..." lines: the answer is this function's one line
    try:
        response = http_request(get_default_host_creds(store.uri), "/api/2.0/mlflow/experiments/search", "GET",
                                params={"max_results": 1}, max_retries=PROBE_TRIES - 1, backoff_factor=1,
                                backoff_jitter=0.0, timeout=PROBE_TIMEOUT_S, raise_on_status=False)
    except Exception as e:  # noqa: BLE001 (requests' and MLflow's own errors: the line names the reason)
        why = unreachable(e) or next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)[:200]
        raise CcexpError(f"{head} does not answer ({why}; {PROBE_TRIES} tries in {time.monotonic() - started:.0f} s): "
                         f"start it, or {store.change(default_uri)}") from None
    finally:
        pool.setLevel(level)
    if response.status_code in (401, 403):
        raise CcexpError(f"{head} refused ccexp's request (HTTP {response.status_code}): give its credentials in "
                         "MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    if response.status_code >= 500:
        raise CcexpError(f"{head} does not answer (HTTP {response.status_code} to every try; {PROBE_TRIES} tries in "
                         f"{time.monotonic() - started:.0f} s): start it, or {store.change(default_uri)}")
    try:
        body = response.json()
    except ValueError:
        body = None
    ok = response.status_code == 200 and isinstance(body, dict) and (not body or "experiments" in body)
    if not ok:
        raise CcexpError(f"{store.uri} ({store.origin}) is not an MLflow tracking server (HTTP {response.status_code} "
                         "to GET /api/2.0/mlflow/experiments/search); give the server's own address, e.g. "
                         "http://host:5000")


def open_store(uri: str):
    """An ``MlflowClient`` on ``uri``. A SQLite store is created and migrated under a file lock next to
    it, so runs that start together on a fresh ``paths.outputs`` do not race on its schema; a new one
    starts as a copy of an empty store at MLflow's schema head
    (``_from_schema_template``), which MLflow opens without migrating. A store this
    call could not finish creating (a full disk) is removed, so none is left half-created; one left
    half-created earlier (its schema migration cut short) is set aside and created anew when it is shown
    to hold no run (a readable file without runs), or named in one line when it holds runs or cannot be
    read (a damaged file: [`damaged_line`][ccexp.tracking.store.damaged_line]), and left untouched.

    Raises:
        CcexpError: for a full disk, or a store that cannot be opened and holds runs or may hold them.
    """
    from mlflow import MlflowClient

    from ccexp.artifacts import file_lock

    from ccexp.errors import disk_full_line

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # schema creation chatter
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(Path(f"{db}.lock"), "runs that start together on a new store may race on creating its tables"):
        for attempt in (1, 2):
            existed = db.is_file()
            if not existed:
                _before_a_new_store(uri, db)
            template = _from_schema_template(db) if not existed and attempt == 1 else None
            try:
                client = MlflowClient(uri)
                client.search_experiments(max_results=1)  # opens the store: creates or migrates its tables here
                return client
            except Exception as e:
                line = disk_full_line(e, db.parent)
                if not existed:  # this call's own half-made store: gone, so nothing looks complete
                    for f in (db, *(Path(f"{db}{suffix}") for suffix in BESIDE_A_STORE)):
                        f.unlink(missing_ok=True)
                if line is not None:
                    raise CcexpError(line.replace("the disk holding", "the disk holding the MLflow store in", 1)
                                     ) from None
                if template is not None:  # a template MLflow does not take: dropped, and MLflow makes the store
                    log.warning("mlflow: a store copied from %s could not be opened (%s); the template is dropped "
                                "and MLflow creates the store", template, str(e).splitlines()[0][:160])
                    _drop(template)
                    continue  # the copy is gone: the next attempt forgets its engine (_before_a_new_store)
                if not existed or attempt == 2:
                    raise
                runs, why = _runs_in(db)
                if runs != 0:  # only a store shown to hold no run is set aside
                    raise CcexpError(damaged_line(db, why or str(e), runs)) from None
                aside = db.with_name(f"{db.name}.half-created-{time.strftime('%Y%m%d-%H%M%S')}")
                _forget_engine(uri)  # MLflow keeps one engine per URI, still open on the file set aside
                os.replace(db, aside)
                log.warning("mlflow: the store %s was left half-created (%s) and held no run: set aside as %s and "
                            "created anew", db, str(e).splitlines()[0][:160], aside.name)
    raise AssertionError("unreachable")


# the files SQLite keeps beside a store (its rollback journal, its write-ahead log and that log's index)
BESIDE_A_STORE = ("-journal", "-wal", "-shm")


def _before_a_new_store(uri: str, db: Path) -> None:
    """Before a new store at ``db`` (which does not exist): forget an engine this process kept for a file at
    ``uri`` since deleted, and rename the journal, WAL and shared-memory files of that deleted store, so the new
    store is not taken for theirs: SQLite would roll a hot journal back onto it (a helper saw a new store come out
    malformed, with the deleted store's run in it). They are kept, not removed; one line says where."""
    _forget_engine(uri)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in BESIDE_A_STORE:
        left = Path(f"{db}{suffix}")
        if left.exists():
            aside = left.with_name(f"{left.name}.of-a-deleted-store-{stamp}")
            os.replace(left, aside)
            log.warning("mlflow: %s was left by a store deleted before; set aside as %s, so the new store %s is "
                        "not taken for it", left.name, aside.name, db.name)


def _from_schema_template(db: Path) -> Path | None:
    """Put at ``db`` (which does not exist) a copy of an empty SQLite store at MLflow's schema head, so
    the client that opens it next skips MLflow's table creation and every migration since its first
    schema (about 1 s on an idle 2-core machine, 0.08 s for the copy; ``benches/bench_store_template.py``).
    MLflow then makes the ``Default`` experiment itself, with this store's own artifact location, as it
    does for a new file, so a store made here cannot be told from one MLflow made.

    The template is made once per MLflow version, schema head and SQLite version (all three in its file
    name, in full) by MLflow's own ``_initialize_tables``, under ``$XDG_CACHE_HOME/ccexp/mlflow-store``
    (``~/.cache`` where that variable is unset or not an absolute path, as the XDG spec says), written
    beside its name and renamed into place, so a half-made one is never copied. Before each copy it must
    be a store at the schema head without an experiment or a run; one that is not (damaged, emptied,
    replaced by a store with runs) is dropped and made anew.

    Returns the template copied, or None where any step fails (a read-only home, MLflow internals of
    another shape): then nothing is put at ``db`` and MLflow creates the store as before. (A deleted
    store's journal beside ``db`` is set aside before, by ``_before_a_new_store``.)
    """
    import shutil

    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        head = _get_latest_schema_revision()
        template = _template_path(head)
        if template.exists() and not template.is_file():  # a folder in its place: nothing to copy, nothing made
            return None
        if template.is_file() and not _empty_at_head(template, head):
            _drop(template)
        if not template.is_file():
            _make_template(template)
        if not _empty_at_head(template, head):
            return None
        copying = db.with_name(f".{db.name}.{os.getpid()}.copying")
        try:
            shutil.copyfile(template, copying)
            os.replace(copying, db)
        finally:
            copying.unlink(missing_ok=True)
        return template
    except Exception as e:  # noqa: BLE001 (any failure: MLflow makes the store itself, as without a template)
        log.debug("mlflow: no schema template for %s (%s); MLflow creates the store", db, e)
        return None


def _template_path(head: str) -> Path:
    """Where the schema template of this MLflow, schema ``head`` and SQLite lives (each in the name, in full)."""
    import sqlite3

    import mlflow

    base = os.environ.get("XDG_CACHE_HOME", "")
    folder = (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "ccexp" / "mlflow-store"
    return folder / f"mlflow-{mlflow.__version__}-schema-{head}-sqlite-{sqlite3.sqlite_version}.db"


def _make_template(template: Path) -> None:
    """MLflow's own table creation and migrations into a file beside ``template``, renamed into place."""
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    template.parent.mkdir(parents=True, exist_ok=True)
    making = template.with_name(f".{template.name}.{os.getpid()}.making")
    engine = sqlalchemy.create_engine(f"sqlite:///{making}")
    try:
        _initialize_tables(engine)
        os.replace(making, template)
    finally:
        engine.dispose()
        making.unlink(missing_ok=True)


def _empty_at_head(path: Path, head: str) -> bool:
    """True when ``path`` is a SQLite store at schema ``head`` without an experiment and without a run."""
    import sqlite3
    from contextlib import closing

    try:
        with closing(sqlite3.connect(_sqlite_uri(path, "ro"), uri=True)) as con:
            return (con.execute("select version_num from alembic_version").fetchall() == [(head,)]
                    and con.execute("select 1 from experiments limit 1").fetchone() is None
                    and con.execute("select 1 from runs limit 1").fetchone() is None)
    except sqlite3.Error:
        return False


def _drop(path: Path) -> None:
    """Remove ``path`` where this process may (a template in a read-only cache stays, and is not copied)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _sqlite_uri(db: Path, mode: str) -> str:
    """SQLite's ``file:`` URI of ``db`` opened in ``mode`` (ro, rw): the path percent-escaped, so a ``%``,
    ``?`` or ``#`` in a folder's name is part of the path, not of the URI."""
    from urllib.parse import quote

    return f"file:{quote(str(db))}?mode={mode}"


def _forget_engine(uri: str) -> None:
    """Close and drop the SQLAlchemy engine MLflow's store class keeps for ``uri`` (its ``_engine_map``), so
    the next client opens the file that is there now."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(uri, None)
    if engine is not None:
        engine.dispose()


def _runs_in(db: Path) -> tuple[int | None, str]:
    """Runs in a SQLite MLflow store read directly, and why they cannot be counted: ``(n, "")``, ``(0, "")``
    for a store without a runs table (its schema migration cut short before it), ``(None, reason)`` when
    that cannot be told (a damaged file: SQLite's quick check fails or the table cannot be read), so a
    damaged store that may hold runs is never taken for an empty one.

    A store this process may write is opened read-write (never created): a run killed while it wrote
    (SIGKILL, the OOM killer) leaves SQLite's rollback journal beside it, "hot", and only a read-write
    connection rolls it back, as SQLite does for any writer that opens it next; a read-only one fails
    with "attempt to write a readonly database" on a store that is whole. Where this process cannot
    write, such a journal is named as the reason.
    """
    import sqlite3
    from contextlib import closing

    writable = os.access(db, os.W_OK) and os.access(db.parent, os.W_OK | os.X_OK)
    try:
        with closing(sqlite3.connect(_sqlite_uri(db, "rw" if writable else "ro"), uri=True, timeout=20)) as con:
            check = [line for row in con.execute("pragma quick_check(4)") for line in str(row[0]).splitlines()]
            if check != ["ok"]:  # a row may start with a line of its own, "*** in database main ***"
                return None, "SQLite's check: " + " ".join(c for c in check if not c.startswith("***"))[:240]
            if not con.execute("select 1 from sqlite_master where type = 'table' and name = 'runs'").fetchone():
                return 0, ""
            return int(con.execute("select count(*) from runs").fetchone()[0]), ""
    except sqlite3.Error as e:
        journal = Path(f"{db}-journal")
        if not writable and journal.is_file() and journal.stat().st_size:
            return None, (f"{JOURNAL_BESIDE} ({journal.name}: a process writing it now, or one killed while it "
                          "wrote), which only a process that may write the store and its folder rolls back")
        if "locked" in str(e):
            return None, f"{LOCKED} for more than 20 s"
        return None, str(e)


# the starts of _runs_in's reasons that are not damage: the line says what to do instead of restoring a copy
JOURNAL_BESIDE = "SQLite's journal is beside it"
LOCKED = "another process holds it locked, writing it,"


def damaged_line(db: Path, why: str, runs: int | None, instead: str = "set logger.tracking_uri to a new store"
                 ) -> str:
    """The line for a SQLite store that cannot be opened (``why``) and holds ``runs`` runs (None: may hold
    some); ``instead``: what else to do (a reader says its own options)."""
    held = "may hold runs" if runs is None else f"holds {runs} run(s)"
    reason = why.splitlines()[0] if why else "unreadable"
    if why.startswith(LOCKED):
        return f"the MLflow store {db} cannot be read now: {reason}; wait for that process, then run this again"
    if why.startswith(JOURNAL_BESIDE):
        return (f"the MLflow store {db} cannot be read here: {reason}; rolling it back makes the store whole, so open "
                f"it once from a process that may write {db.parent}, or {instead}")
    if len(reason) > 240:
        reason = reason[:240].rsplit(" ", 1)[0] + " ..."
    return f"the MLflow store {db} cannot be opened ({reason}) and {held}; restore it from a copy, or {instead}"


def check_sqlite(db: Path, write: bool = False, instead: str = "set logger.tracking_uri to a new store") -> None:
    """Refuse, before any stage, a SQLite store file that cannot be read (a store left half-created is
    readable, and set aside later by [`open_store`][ccexp.tracking.store.open_store] when it holds no run), and with ``write`` one a run
    could not write to (a read-only or immutable file, or a folder where SQLite cannot put its journal).

    Raises:
        CcexpError: for a damaged file ([`damaged_line`][ccexp.tracking.store.damaged_line]) or one that cannot be written.
    """
    if db.is_file() and db.stat().st_size:
        runs, why = _runs_in(db)
        if runs is None:
            raise CcexpError(damaged_line(db, why, None, instead))
    if not write:
        return
    import tempfile

    from ccexp.artifacts import folder_problem

    problem = folder_problem(db.parent)
    if problem is not None:
        raise CcexpError(f"the MLflow store {db} cannot be made ({problem}); {instead}")
    try:
        if db.is_file():
            with open(db, "r+b"):
                pass
        if db.parent.is_dir():
            with tempfile.TemporaryFile(dir=db.parent):
                pass
    except OSError as e:
        raise CcexpError(f"the MLflow store {db} cannot be written ({e.strerror}: "
                         f"{e.filename or db}); make it writable, or set logger.tracking_uri to another store"
                         ) from None


def read_store(uri: str):
    """An ``MlflowClient`` on an existing store, for a reader (``ccexp.report``, ``ccexp.ui``): nothing is
    created, migrated or set aside.

    Raises:
        CcexpError: for a SQLite store that cannot be opened ([`damaged_line`][ccexp.tracking.store.damaged_line]).
    """
    from mlflow import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    db = Path(uri[len("sqlite:///"):])
    instead = "pass another store (--store or --tracking-uri)"
    check_sqlite(db, instead=instead)
    try:
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 (SQLAlchemy's and MLflow's own types for a damaged file)
        raise CcexpError(damaged_line(db, str(e), _runs_in(db)[0], instead)) from None
    return client


def ensure_experiment(client, name: str, artifact_location: str | Path | None, local: bool = True) -> str:
    """The id of experiment ``name``, created if it does not exist, with its artifacts in
    ``artifact_location`` (a folder or a URI; None: where the server puts them).

    A new experiment is tagged a classic ML experiment (``mlflow.experimentKind =
    custom_model_development``), so MLflow 3's UI opens it on the runs table rather than its GenAI
    traces view; in a ``local`` store the empty ``Default`` experiment is removed so it does not sit
    beside it (a team's server keeps its own).
    """
    from mlflow.exceptions import MlflowException

    if artifact_location is not None and "://" not in str(artifact_location) and \
            not str(artifact_location).startswith("mlflow-artifacts:"):
        folder = Path(artifact_location).resolve()
        if local:
            folder.mkdir(parents=True, exist_ok=True)
        artifact_location = folder.as_uri()
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        experiment_id = client.create_experiment(name, artifact_location=artifact_location,
                                                 tags={"mlflow.experimentKind": "custom_model_development"})
    except MlflowException as e:  # another run created it in the meantime
        if unreachable(e) is not None:
            raise
        return client.get_experiment_by_name(name).experiment_id
    if not local:
        return experiment_id
    default = client.get_experiment_by_name("Default")
    if default is not None and default.lifecycle_stage == "active" and \
            not client.search_runs([default.experiment_id], max_results=1):
        client.delete_experiment(default.experiment_id)
    return experiment_id
