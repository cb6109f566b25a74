"""Round 5 of the team's ``shared/cases`` (c32-c42; c43-c44 are the sweep issue's), each the kind of fault it
stands for, asserting the right behaviour. The corpora are the cases' own, copied to ``tests/cases/``:
``round4.jsonl`` (300 documents: c32, c33, c38b, c40, c41), ``round5-150.jsonl`` (c34) and ``round5-120.jsonl``
(c35, c38)."""
from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ccexp.errors import CcexpError
from ccexp.names import RunIdentity
from warm import python_m, python_popen
from conftest import ROOT, run_ccexp
from test_cases import CASES, one_line, runs

# the cases' own small run: 4 clusters, rows of 64 tokens, 512 tokens a step
SMALL = ["data=jsonl", "data.label_fields=[domain]", "clusterer.k=4", "train.tokens_per_step=512",
         "train.micro_batch_size=8", "train.seq_len=64", "eval.max_tokens=63", "model.n_positions=64",
         "model.tokenizer.vocab_size=512", "trainer.enable_progress_bar=false"]


def small(tmp_path: Path, corpus: str, *args: str) -> list[str]:
    return [*SMALL, f"data.path={CASES / corpus}", f"paths.outputs={tmp_path / 'out'}", *args]


def start(tmp_path: Path, args: list[str], log: Path):
    """``python -m ccexp <args>`` started in the background, its output (stderr too) written to ``log`` as it comes
    (tests/warm.py: warm where a warm process is free)."""
    import os

    return python_popen("ccexp", *args, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=log,
                        merge=True)


# -- c32: a run's identity is its whole configuration, never a short name hash ------------------------------------------
def colliding_learning_rates(args: list[str]) -> tuple[str, str, str]:
    """Two train.lr values whose configurations get the same 4-hex run name (searched, as the case does)."""
    from ccexp.config import compose
    from ccexp.names import run_name

    cfg = compose(args)  # composed once; each learning rate set on it as the command line would
    seen: dict[str, str] = {}
    for i in range(1, 20000):
        lr = f"{i * 1e-5:.5f}"
        cfg.train.lr = float(lr)
        name = run_name(cfg)
        if name in seen:
            return seen[name], lr, name
        seen[name] = lr
    raise AssertionError("no collision in 20,000 learning rates")


def test_c32_two_configurations_of_one_short_name_are_two_configurations(tmp_path):
    """The kind, at every place a run is matched: resume (run.json's full digest), the run record (its MLflow run
    tagged with the digest, a continued run matched on it) and the report (its newest-run-per-configuration)."""
    from ccexp.launch.resume import find_resume, release_claims, write_run_json

    a = RunIdentity("random-k4-s0-abcd", "abcd" + "1" * 60)
    b = RunIdentity("random-k4-s0-abcd", "abcd" + "2" * 60)
    folder = tmp_path / "runs" / "d" / "a"
    write_run_json(folder, run_name=a.name, status="finished", config_digest=a.digest, metrics={"ppl": 9.0})
    try:
        assert find_resume(None, a, None, tmp_path).finished.folder == folder
        other = find_resume(None, b, None, tmp_path)
        assert other.finished is None and other.checkpoint is None  # not "finished; nothing to do"
        assert other.identity.name == "random-k4-s0-abcd2222" and other.identity.digest == b.digest
        assert b.distinct({b.name, "random-k4-s0-abcd2222"}).name == "random-k4-s0-abcd22222222"
    finally:
        release_claims()


def test_c32_the_report_keeps_both_configurations_of_one_run_name():
    from types import SimpleNamespace

    from ccexp.compare.report import configuration_of

    def run(digest, params):
        return SimpleNamespace(data=SimpleNamespace(tags={"config_digest": digest} if digest else {}, params=params),
                               info=SimpleNamespace(run_name="random-k4-s0-abcd"))

    assert configuration_of(run("1" * 64, {})) != configuration_of(run("2" * 64, {}))
    # runs from before the tag: their params tell them apart, where they wrote does not
    assert configuration_of(run(None, {"train.lr": "0.1", "paths.outputs": "a"})) == \
        configuration_of(run(None, {"train.lr": "0.1", "paths.outputs": "b"}))
    assert configuration_of(run(None, {"train.lr": "0.1"})) != configuration_of(run(None, {"train.lr": "0.2"}))


@pytest.mark.slow
def test_c32_a_learning_rate_that_shares_the_run_name_trains_under_a_name_of_its_own(tmp_path):
    args = small(tmp_path, "round4.jsonl", "train.steps=8", "logger=mlflow")
    lr_a, lr_b, name = colliding_learning_rates([a for a in args if not a.startswith("paths.")])
    first = run_ccexp(*args, f"train.lr={lr_a}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_ccexp(*args, f"train.lr={lr_b}", cwd=tmp_path)
    log = second.stdout + second.stderr
    assert second.returncode == 0 and "nothing to do" not in log and "train: step 8/8" in log, log[-3000:]
    assert re.search(rf"hold another configuration .*: not this run, which is named {name}[0-9a-f]{{4}}", log)
    client, found = runs(tmp_path / "out")
    assert len(found) == 2 and all(r.info.status == "FINISHED" for r in found)
    assert len({r.info.run_name for r in found}) == 2 and len({r.data.tags["config_digest"] for r in found}) == 2
    from ccexp.compare.report import collect

    assert len(collect(client, experiment="ccexp")) == 2  # the report compares both


# -- c33: two identical commands at once --------------------------------------------------------------------------------
@pytest.mark.slow
def test_c33_of_two_identical_commands_started_together_one_trains_and_the_other_is_one_line(tmp_path):
    args = small(tmp_path, "round4.jsonl", "train.steps=30", "logger=mlflow")
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    first = start(tmp_path, args, logs[0])
    time.sleep(1)
    second = start(tmp_path, args, logs[1])
    codes = [first.wait(600), second.wait(600)]
    texts = [p.read_text() for p in logs]
    assert sorted(codes) == [0, 2], texts
    refused = texts[codes.index(2)]
    lines = [ln for ln in refused.splitlines() if ln.startswith("ccexp: error:")]
    assert len(lines) == 1 and re.search(r"is running now \(pid \d+ on \S+, .*\); wait for it", lines[0]), refused
    assert "Traceback" not in refused and "train: step" not in refused
    _, found = runs(tmp_path / "out")
    assert [r.info.status for r in found] == ["FINISHED"]


# -- c34: a run killed outright ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_c34_a_run_killed_by_sigkill_is_said_and_recorded_killed_by_the_next_command(tmp_path):
    args = small(tmp_path, "round5-150.jsonl", "sampler=random", "clusterer.k=2", "train.steps=40",
                 "train.log_every_n_steps=1", "logger=mlflow")
    log = tmp_path / "1.log"
    proc = start(tmp_path, args, log)
    deadline = time.monotonic() + 600
    while not re.search(r"train: step [3-9]/40", log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (killed,) = (tmp_path / "out").glob("runs/*/*/run.json")
    assert json.loads(killed.read_text())["status"] == "running"
    again = run_ccexp(*args, cwd=tmp_path)
    text = again.stdout + again.stderr
    assert again.returncode == 0, text[-3000:]
    assert re.search(r"resume: random-k2-s0-[0-9a-f]{4} \(.*\) was killed \(its process is gone; run.json still said "
                     r"running\): it left no checkpoint", text), text[-3000:]
    assert re.search(r"resume: random-k2-s0-[0-9a-f]{4} killed before its first checkpoint \(.*\): starting from step "
                     r"0", text), text[-3000:]
    assert json.loads(killed.read_text())["status"] == "killed"
    _, found = runs(tmp_path / "out")
    assert [r.info.status for r in found] == ["KILLED", "FINISHED"]
    assert found[0].data.tags["ended_by"].startswith("the next run of its configuration")


_KILLED_WRITER = """
import os, signal, sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("pragma cache_size=2")  # the changed pages spill to the file: its old pages are in the journal
con.execute("begin immediate")
con.execute("update runs set name = name || ?", ("x" * 2000,))
os.kill(os.getpid(), signal.SIGKILL)
"""


def _mlflow_store_killed_mid_write(db: Path, experiment: str = "c34") -> tuple[str, list[str]]:
    """An MLflow store of three runs in ``experiment`` whose writer was then killed mid-write (its hot journal
    beside it); the experiment's id and the runs' ids."""
    from ccexp.tracking.store import open_store

    client = open_store(f"sqlite:///{db}")
    experiment_id = client.create_experiment(experiment)
    made = [client.create_run(experiment_id, run_name="r" * 200).info.run_id for _ in range(3)]
    subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(db)], check=False, timeout=120)
    assert Path(f"{db}-journal").stat().st_size > 0  # the killed writer's hot journal
    return experiment_id, made


def test_c34_a_store_whose_writer_was_killed_mid_write_is_whole_and_read_by_the_next_command(tmp_path):
    """The kind: a run killed while MLflow wrote to its SQLite store (SIGKILL, the OOM killer) leaves SQLite's hot
    rollback journal, and a look at the store that opened it read-only took a whole store for a damaged one
    (CI, stop 66: c34's next command refused the store). Its places: ``_runs_in``, under ``check_sqlite`` (the
    pre-flight of a run and of ccexp.ui's server) and ``read_store`` (ccexp.report, ccexp.ui), and under
    ``open_store``'s choice to set a store aside."""
    from ccexp.tracking.store import _runs_in, check_sqlite, read_store

    db = tmp_path / "mlflow.db"
    experiment, made = _mlflow_store_killed_mid_write(db)
    assert _runs_in(db) == (3, "")
    check_sqlite(db, write=True)
    found = read_store(f"sqlite:///{db}").search_runs([experiment])
    assert sorted(r.info.run_id for r in found) == sorted(made)
    assert {r.info.run_name for r in found} == {"r" * 200}  # the killed write rolled back, nothing half-made


def _killed_mid_write(db: Path) -> None:
    """A SQLite file with a runs table of three rows (what ``_runs_in`` counts) whose writer was then killed
    mid-write (its hot journal beside it)."""
    import sqlite3
    from contextlib import closing

    db.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(db)) as con, con:
        con.execute("create table runs (run_uuid text, name text)")
        con.executemany("insert into runs values (?, ?)", [(str(i), "r" * 2000) for i in range(3)])
        con.execute("create table filler (x text)")
        con.executemany("insert into filler values (?)", [("f" * 2000,) for _ in range(40)])
    subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(db)], check=False, timeout=120)
    assert Path(f"{db}-journal").stat().st_size > 0


def test_c34_a_deleted_stores_journal_is_never_rolled_onto_a_new_store(tmp_path, monkeypatch):
    """A helper's finding: the store deleted, its killed writer's journal left, the next new store (copied from the
    schema template) took the journal for its own and rolled it back onto itself: damaged, with the deleted store's
    run in it. A new store beside such files is MLflow's own new file, which ignores them."""
    import sqlite3
    from contextlib import closing

    from ccexp.tracking.store import _runs_in, open_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    db = tmp_path / "mlflow.db"
    _mlflow_store_killed_mid_write(db, "deleted")
    db.unlink()  # the store deleted, its journal left (and this process's engine on it: forgotten by open_store)
    open_store(f"sqlite:///{db}")
    with closing(sqlite3.connect(db)) as con:
        assert con.execute("pragma quick_check").fetchall() == [("ok",)]
        assert "deleted" not in {name for (name,) in con.execute("select name from experiments")}
    assert _runs_in(db) == (0, "")
    (aside,) = tmp_path.glob("mlflow.db-journal.of-a-deleted-store-*")  # kept, not removed
    assert aside.stat().st_size > 0 and not Path(f"{db}-journal").exists()


def test_a_template_that_is_not_an_empty_store_at_the_schema_head_is_made_anew_and_never_copied(tmp_path,
                                                                                                monkeypatch):
    """A helper's finding: a store with runs put at the template's path gave every new store its runs (and their
    artifact folder)."""
    from ccexp.tracking.store import _runs_in, open_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    open_store(f"sqlite:///{tmp_path / 'first.db'}")
    (template,) = (tmp_path / "cache" / "ccexp" / "mlflow-store").glob("*.db")
    used = open_store(f"sqlite:///{tmp_path / 'used.db'}")
    used.create_run(used.create_experiment("other"))
    template.write_bytes((tmp_path / "used.db").read_bytes())  # a store with a run in the template's place
    client = open_store(f"sqlite:///{tmp_path / 'new.db'}")
    assert [e.name for e in client.search_experiments()] == ["Default"] and _runs_in(tmp_path / "new.db") == (0, "")
    assert _runs_in(template) == (0, "")  # made anew
    template.write_bytes(b"")  # emptied: made anew too, not left to fall back for ever
    open_store(f"sqlite:///{tmp_path / 'newer.db'}")
    assert template.stat().st_size > 0 and _runs_in(template) == (0, "")


@pytest.mark.parametrize("folder", ["p%41q", "h#x", "q?x"])
def test_a_store_in_a_folder_whose_name_has_uri_characters_is_read_where_it_is(tmp_path, folder):
    """A helper's finding: the read-only look put the path in a ``file:`` URI unescaped: ``p%41q`` opened
    ``pAq`` (called damaged), ``h#x`` and ``q?x`` created a stray empty file and counted 0 runs."""
    from ccexp.tracking.store import _runs_in

    db = tmp_path / folder / "mlflow.db"
    _killed_mid_write(db)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _runs_in(db) == (3, "") and sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_damaged_stores_line_quotes_sqlites_check(tmp_path):
    """A helper's finding: SQLite's check gives its finding in the row that starts "*** in database main ***", and the
    line said "SQLite's check: " with nothing after it."""
    import sqlite3
    from contextlib import closing

    from ccexp.tracking.store import _runs_in

    db = tmp_path / "cut.db"
    with closing(sqlite3.connect(db)) as con, con:
        con.execute("create table runs (x text)")
        con.executemany("insert into runs values (?)", [("a" * 300,)] * 400)
    damaged = bytearray(db.read_bytes())
    damaged[4 * 4096 + 8:4 * 4096 + 40] = b"\xff" * 32  # page 5's cell pointers point outside the page
    db.write_bytes(bytes(damaged))
    assert _runs_in(db) == (None, "SQLite's check: " + " ".join(
        [f"On tree page 5 cell {c}: Offset 65535 out of range 118..4092" for c in (12, 11, 10, 9)]))


def test_ccexp_ui_on_a_read_only_store_is_one_line(tmp_path):
    """A helper's finding: ``ccexp.ui`` saves its view in the store (an experiment tag), and on a read-only mount it
    ended with MLflow's traceback."""
    from ccexp.tracking.store import open_store

    client = open_store(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("ccexp"), tags={"sampler": "random"}).info.run_id
    client.log_metric(run, "eval/bpb", 1.2)
    client.set_terminated(run)
    mounted = tmp_path / "read-only"
    mounted.mkdir()
    if subprocess.run(["mount", "--bind", str(tmp_path / "store"), str(mounted)], capture_output=True).returncode:
        pytest.skip("a read-only bind mount needs root (CAP_SYS_ADMIN)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], check=True, capture_output=True)
        proc = python_m("ccexp.ui", "--store", str(mounted / "mlflow.db"), "--no-server", cwd=tmp_path, timeout=300)
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ccexp.ui: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "cannot be written here (read-only), and ccexp.ui saves its view in it" in errors[0]


# -- c35: a tracking URI MLflow cannot use -------------------------------------------------------------------------------
@pytest.mark.parametrize("uri, why", [
    ("127.0.0.1:5917", "without a scheme it is read as a file path; did you mean http://127.0.0.1:5917?"),
    ("./mlruns", "a path is MLflow's file store, which MLflow 3 refuses"),
    ("file:///tmp/mlruns", "a path is MLflow's file store, which MLflow 3 refuses"),
    ("htp://host:5000", "the scheme htp:// is not one MLflow stores runs in"),
    ("https://", "https:// needs a host"),
    ("sqlite://x.db", "a SQLite store is sqlite:/// and a path"),
])
def test_c35_a_tracking_uri_mlflow_cannot_use_is_one_line_wherever_it_is_given(uri, why):
    """The kind, at its one place: every store a command uses is a ``Store`` (a run's, a sweep's, ccexp.report's,
    ccexp.ui's, ccexp.deliver's), which refuses such a URI when it is made."""
    from ccexp.tracking.mlflow_run import run_store
    from ccexp.compare.report import cli_store
    from ccexp.tracking.store import Store

    with pytest.raises(CcexpError, match=re.escape(f"logger.tracking_uri={uri!r} is not a tracking URI MLflow can use "
                                                   f"({why}")):
        run_store(uri, Path("outputs"))
    with pytest.raises(CcexpError, match=re.escape(f"--tracking-uri={uri!r} is not a tracking URI MLflow can use")):
        cli_store(None, uri)
    for fine in ("http://127.0.0.1:5000", "https://mlflow.example.com", "sqlite:///tmp/x/mlflow.db"):
        Store(fine, "logger.tracking_uri")
    database = "postgresql+psycopg2://u@host/db"  # a database store: fine where its driver is installed
    if importlib.util.find_spec("psycopg2") is not None:
        Store(database, "logger.tracking_uri")
    else:
        with pytest.raises(CcexpError, match="its database driver is not installed"):
            Store(database, "logger.tracking_uri")


def test_c35_a_uri_without_its_scheme_stops_the_run_and_deliver_before_any_work(tmp_path):
    env = {"MLFLOW_TRACKING_URI": "127.0.0.1:5917"}
    run = run_ccexp(*small(tmp_path, "round5-120.jsonl", "clusterer.k=2", "train.steps=2"), cwd=tmp_path, env=env)
    line = one_line(run, 2)
    assert line == ("ccexp: error: MLFLOW_TRACKING_URI='127.0.0.1:5917' is not a tracking URI MLflow can use (without "
                    "a scheme it is read as a file path; did you mean http://127.0.0.1:5917?)")
    assert "embed:" not in run.stdout + run.stderr and not (tmp_path / "out" / "cache").exists()
    store = tmp_path / "store"
    store.mkdir()
    from mlflow import MlflowClient

    c = MlflowClient(f"sqlite:///{store}/mlflow.db")
    c.create_run(c.create_experiment("ccexp"), run_name="r", tags={"ccexp.server_uri": "http://127.0.0.1:5000"})
    deliver = python_m("ccexp.deliver", str(store), "--tracking-uri", "127.0.0.1:5000", timeout=120, cwd=tmp_path)
    assert deliver.returncode == 2 and "Traceback" not in deliver.stderr, deliver.stderr[-2000:]
    assert deliver.stderr.strip().endswith("--tracking-uri='127.0.0.1:5000' is not a tracking URI MLflow can use "
                                           "(without a scheme it is read as a file path; did you mean "
                                           "http://127.0.0.1:5000?)")


# -- c36: a store delivered from where it was moved ----------------------------------------------------------------------
def make_fallback_store(folder: Path, table: Path) -> str:
    """A run folder's local store as ccexp's FallbackClient writes it with its server away (a closed port)."""
    import os

    from ccexp.tracking.server import FallbackClient

    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        c = FallbackClient("http://127.0.0.1:9", folder)
        run = c.create_run("ccexp", "clusterclip-k4-s0-abcd", {})
        c.log_metric(run, "eval/ppl", 12.5, step=20)
        c.log_artifact(run, str(table), "tables")
        c.set_terminated(run, "FINISHED")
    finally:
        os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)
    return run


def test_c36_a_store_moved_with_its_run_folder_delivers_its_artifacts_from_where_it_is(tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)  # the SQLite target's artifacts go to MLflow's default, ./mlruns

    from mlflow import MlflowClient

    from ccexp.tracking.server import deliver_store

    table = tmp_path / "table.csv"
    table.write_text("cluster,weight\n0,1\n")
    make_fallback_store(tmp_path / "run" / "mlflow-local", table)
    shutil.move(tmp_path / "run", tmp_path / "moved")
    target = f"sqlite:///{tmp_path / 'target.db'}"
    ((name, server_id, counts, _),) = deliver_store(tmp_path / "moved" / "mlflow-local", target)
    assert counts["artifacts"] == 1
    assert [f.path for f in MlflowClient(target).list_artifacts(server_id, "tables")] == ["tables/table.csv"]
    # a store moved without its artifacts: one line, and the run is not marked delivered (a later try can deliver)
    make_fallback_store(tmp_path / "run2" / "mlflow-local", table)
    shutil.move(tmp_path / "run2", tmp_path / "moved2")
    shutil.rmtree(tmp_path / "moved2" / "mlflow-local" / "artifacts")
    with pytest.raises(CcexpError, match=r"the artifacts of run clusterclip-k4-s0-abcd were recorded at .*, which is "
                                         r"gone, and are not under the store's folder .* either"):
        deliver_store(tmp_path / "moved2" / "mlflow-local", f"sqlite:///{tmp_path / 'target2.db'}")
    local = MlflowClient(f"sqlite:///{tmp_path / 'moved2' / 'mlflow-local' / 'mlflow.db'}")
    (run,) = local.search_runs([local.get_experiment_by_name("ccexp").experiment_id])
    assert "ccexp.delivered" not in run.data.tags and not [k for k in run.data.tags if "delivered" in k]


# -- c37: every argument of the report and the UI ------------------------------------------------------------------------
def test_c37_report_and_ui_arguments_that_name_nothing_here_are_one_line(tmp_path):
    from mlflow import MlflowClient

    store = tmp_path / "mlflow.db"
    c = MlflowClient(f"sqlite:///{store}")
    exp = c.create_experiment("ccexp")
    sweep = c.create_run(exp, run_name="sweep-x", tags={"ccexp.sweep": "true"}).info.run_id
    plain = c.create_run(exp, run_name="a-run").info.run_id
    (tmp_path / "notes.txt").write_text("x")
    missing = "0123456789abcdef0123456789abcdef"
    cases = [
        ("report", ["--parent", missing], f"--parent {missing}: no run with that id in sqlite:///{store}; the latest "
                                          f"sweep there is {sweep} (or omit --parent)"),
        ("report", ["--parent", plain], f"--parent {plain}: run a-run is not a sweep's parent run"),
        ("report", ["--parent", sweep, "--experiment", "nope"], "no MLflow experiment 'nope' in this store"),
        ("report", ["--all-runs", "--out", str(tmp_path / "notes.txt")], f"--out {tmp_path / 'notes.txt'} is a file; "
                                                                          "give a folder"),
        ("report", ["--all-runs", "--out", str(tmp_path / "notes.txt" / "r")], "cannot be made"),
        ("ui", ["--no-server", "--parent", missing], f"--parent {missing}: no run with that id"),
        ("ui", ["--host", "nonsense.invalid"], "--host nonsense.invalid: not a name or address this machine can "
                                               "resolve"),
    ]
    for entry, args, message in cases:
        proc = python_m(f"ccexp.{entry}", "--store", str(store), *args, timeout=120, cwd=tmp_path)
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"ccexp.{entry}: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
        assert message in errors[0], (args, errors[0])


# -- c38: an extra logger that cannot start -------------------------------------------------------------------------------
def test_c38_a_logger_that_cannot_start_is_one_line_before_any_stage(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    for extra, message in [
        (f"logger.loggers.tensorboard.save_dir={tmp_path / 'notes.txt' / 'tb'}",
         f"logger.loggers.tensorboard.save_dir='{tmp_path / 'notes.txt' / 'tb'}' cannot be made "
         f"({tmp_path / 'notes.txt'} is not a folder); give a folder you can write"),
        ("+logger.loggers.tensorboard.bogus=1",
         "logger.loggers.tensorboard (lightning.pytorch.loggers.TensorBoardLogger) cannot start: TypeError: "
         "SummaryWriter.__init__() got an unexpected keyword argument 'bogus'"),
    ]:
        proc = run_ccexp(*small(tmp_path, "round5-120.jsonl", "clusterer.k=2", "train.steps=2", "logger=tensorboard",
                                extra), cwd=tmp_path)
        assert one_line(proc, 2) == f"ccexp: error: {message}"
        assert not (tmp_path / "out" / "cache").exists() and not list((tmp_path / "out").glob("runs/*/*/run.json"))
    assert not list(tmp_path.glob("out/tensorboard/*"))  # the trial start's scratch folder is gone


def test_c38_a_logger_that_fails_when_the_run_opens_ends_the_mlflow_run_failed_and_names_it(tmp_path, monkeypatch):
    """What the pre-flight cannot know (a disk that fills between the two): the run record's opening fails, its MLflow
    run is ended FAILED, its run.json says failed, and the line names the logger."""
    from ccexp.config import compose
    from ccexp.tracking import mlflow_run
    from ccexp.training import extras

    def broken(logger, params):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(extras, "start_tensorboard", broken)
    cfg = compose(["logger=tensorboard", f"logger.loggers.tensorboard.save_dir={tmp_path / 'tb'}",
                   f"paths.outputs={tmp_path / 'out'}"])
    record = mlflow_run.RunRecord(cfg, tmp_path / "out", tmp_path / "run")
    with pytest.raises(CcexpError, match=r"logger.loggers.tensorboard could not start \(OSError: \[Errno 28\] No space "
                                         r"left on device\); the MLflow run is ended FAILED"):
        with record:
            pass
    assert record.client.get_run(record.logger.run_id).info.status == "FAILED"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


# -- c39: the local Slurm cluster stops its jobs' processes too ------------------------------------------------------------
@pytest.mark.slow
def test_c39_stopping_the_local_slurm_cluster_leaves_no_job_process_behind(tmp_path):
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        pytest.skip("needs root and Debian's slurm-wlm (CI installs them)")
    script = ROOT / "scripts" / "slurm_local.sh"
    folder = tmp_path / "slurm"
    env = {**os.environ, "CCEXP_SLURM_PORT": "6987"}
    start = subprocess.run(["bash", str(script), "start", str(folder)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert start.returncode == 0, start.stdout + start.stderr
    env["SLURM_CONF"] = str(folder / "slurm.conf")
    try:
        job = subprocess.run(["sbatch", "--parsable", "-o", str(folder / "job.out"), "--wrap",
                              "trap 'echo TERM: saving' TERM; sleep 120 & wait; sleep 120"], env=env,
                             capture_output=True, text=True, timeout=60).stdout.strip()
        for _ in range(30):
            if subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], env=env, capture_output=True,
                              text=True).stdout.strip() == "R":
                break
            time.sleep(1)
    finally:
        stop = subprocess.run(["bash", str(script), "stop", str(folder)], env=env, capture_output=True, text=True,
                              timeout=180)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    left = subprocess.run(["pgrep", "-af", f"slurmstepd: \\[{job}\\.|sleep 120"], capture_output=True, text=True).stdout
    assert not left.strip(), left


# -- c40: a weights file that gives a cluster twice --------------------------------------------------------------------
def test_c40_every_json_a_user_hands_in_refuses_a_key_given_twice(tmp_path):
    """The kind at its one place per format (ccexp.data.userfiles): mixture weights, DoReMi's reference losses (a
    list: no keys) and a corpus's records."""
    from ccexp.data.corpus import CorpusReader
    from ccexp.sampling.mixture import mixture_weights

    weights = tmp_path / "weights.json"
    weights.write_text('{"0": 0.1, "1": 0.2, "2": 0.3, "3": 0.4, "0": 5}')
    with pytest.raises(CcexpError, match=re.escape(f"sampler.weights='{weights}' lists cluster '0' twice; give each "
                                                   "cluster once")):
        mixture_weights(str(weights), np.array([5, 5, 5, 5]))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": "two", "text": "three"}\n')
    with pytest.raises(CcexpError, match=re.escape(f"{corpus}:2: the record gives the field 'text' twice")):
        list(CorpusReader(path=str(corpus)).batches(10))


def test_c40_a_json_weights_file_with_a_repeated_cluster_is_refused_before_any_stage(tmp_path):
    weights = tmp_path / "weights.json"
    weights.write_text('{"0": 0.1, "1": 0.2, "2": 0.3, "3": 0.4, "0": 5}')
    proc = run_ccexp(*small(tmp_path, "round4.jsonl", "train.steps=2", "logger=none", "sampler=mixture",
                            f"sampler.weights={weights}"), cwd=tmp_path)
    assert one_line(proc, 2) == f"ccexp: error: sampler.weights='{weights}' lists cluster '0' twice; give each " \
                                "cluster once"


# -- c41: a two-step sampler where no prior run happens -----------------------------------------------------------------
def test_c41_the_plan_of_a_learned_mixture_says_what_it_cannot_do_and_the_sweep_check_skips_it(tmp_path, caplog):
    from ccexp.launch.arms import find_duplicates

    proc = python_m("ccexp.plan", *small(tmp_path, "round4.jsonl", "train.steps=6"), "logger=none",
                    "sampler=doremi_mixture", timeout=300, cwd=tmp_path)
    assert one_line(proc, 2) == ("ccexp: error: sampler.weights=doremi is learned by a training run's proxy stage "
                                 "(python -m ccexp: DoReMi's proxy run first); here give a list, a .csv or .json "
                                 "file, or the folder of the run that trained on them")
    jobs = [[*small(tmp_path, "round4.jsonl", "train.steps=6"), "logger=none", f"sampler={s}"]
            for s in ("random", "doremi_mixture", "doremi")]
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ccexp.config import register

    register()  # the schemas, as python -m ccexp registers them
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "ccexp" / "conf")), \
            caplog.at_level("WARNING", logger="ccexp"):
        assert find_duplicates(hydra_compose("config", overrides=jobs[0]), jobs) == []
    GlobalHydra.instance().clear()
    assert "cannot run" not in caplog.text


# -- c42: data.sources as plain paths -----------------------------------------------------------------------------------
def test_c42_data_sources_given_as_plain_paths_are_read_and_other_shapes_named(tmp_path):
    from ccexp.data.sources import source_entries, source_names, source_weights

    assert source_names(["/data/cooking.jsonl", {"path": "web.jsonl.gz", "name": "w"}]) == ["cooking", "w"]
    assert source_weights(["a.jsonl", "b.jsonl"]) is None
    assert source_entries(["a.jsonl"]) == [{"path": "a.jsonl"}]
    for bad, shown in ((3, "3, a number"), (None, "null"), (["a", "b"], "a list (2 items)")):
        with pytest.raises(CcexpError, match=re.escape(f"data.sources[1] is {shown}; give each source as a path or as "
                                                       "{path: ..., weight: ..., name: ...}")):
            source_names(["a.jsonl", bad])
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    lines = (CASES / "round4.jsonl").read_text().splitlines()
    first.write_text("\n".join(lines[:150]) + "\n")
    second.write_text("\n".join(lines[150:]) + "\n")
    proc = run_ccexp("data=sources", "data.label_fields=[source,domain]", f"data.sources=[{first},{second}]",
                     "clusterer.k=4", "train.steps=2", "logger=none", f"paths.outputs={tmp_path / 'out'}",
                     "train.tokens_per_step=512", "train.micro_batch_size=8", "train.seq_len=64", "eval.max_tokens=63",
                     "model.n_positions=64", "model.tokenizer.vocab_size=512", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from first.jsonl, second.jsonl" in proc.stdout + proc.stderr


# -- what a breaker found, inputs of the same kinds (helper, this stop) ---------------------------------------------------
def test_c32_a_weights_file_rewritten_in_place_is_another_configuration(tmp_path):
    from ccexp.config import compose
    from ccexp.names import run_identity

    weights = tmp_path / "w.json"
    weights.write_text("[1, 1, 1, 1]")
    args = ["sampler=mixture", f"sampler.weights={weights}"]
    before = run_identity(compose(args))
    weights.write_text("[0, 0, 0, 1]")
    after = run_identity(compose(args))
    assert before.digest != after.digest  # the bytes it trains on are part of what it is
    assert run_identity(compose(["sampler=random"])).digest == run_identity(compose(["sampler=random"])).digest


def test_c34_a_dead_run_of_another_configuration_is_recorded_killed_by_any_next_command(tmp_path):
    from ccexp.launch.resume import find_resume, release_claims, write_run_json

    other = tmp_path / "runs" / "d" / "other"
    write_run_json(other, run_name="random-k4-s0-ffff", status="running", config_digest="f" * 64)
    meta = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**meta, "pid": 999_999_999}))  # a process long gone, on this host
    try:
        resume = find_resume(None, RunIdentity("uniform-k4-s0-abcd", "a" * 64), None, tmp_path)
    finally:
        release_claims()
    assert [d.folder for d in resume.dead] == [other]
    assert json.loads((other / "run.json").read_text())["status"] == "killed"


@pytest.mark.parametrize("uri, why", [
    ("http://[::1:5000", "not a URL (Invalid IPv6 URL)"),
    ("http://host:abc", "not a URL (Port could not be cast to integer value as 'abc')"),
    ("postgresql://u@127.0.0.1:1/db", "its database driver is not installed"),
    ("databricks", "a Databricks workspace is not a store ccexp checks or writes offline"),
])
def test_c35_more_uris_mlflow_cannot_use_are_one_line(uri, why):
    from ccexp.tracking.store import Store

    with pytest.raises(CcexpError, match=re.escape(why)):
        Store(uri, "MLFLOW_TRACKING_URI")
    assert Store(" HTTP://127.0.0.1:5000 ", "MLFLOW_TRACKING_URI").uri == "http://127.0.0.1:5000"  # spaces, capitals
    assert Store("HTTPS://h", "MLFLOW_TRACKING_URI").is_server


def test_c36_deliver_refuses_a_damaged_store_the_store_itself_and_an_empty_name_and_reads_the_db_file(tmp_path):
    from ccexp.tracking.server import deliver_store

    table = tmp_path / "table.csv"
    table.write_text("cluster,weight\n0,1\n")
    store = tmp_path / "run" / "mlflow-local"
    make_fallback_store(store, table)
    with pytest.raises(CcexpError, match=r"is the local store itself"):
        deliver_store(store, f"sqlite:///{store / 'mlflow.db'}")
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (store / "mlflow.db").read_bytes()
    (cut / "mlflow.db").write_bytes(data[: len(data) // 3])
    with pytest.raises(CcexpError, match=r"mlflow.db"):
        deliver_store(cut, f"sqlite:///{tmp_path / 'target.db'}")
    for arg, message in ((str(store / "mlflow.db"), "deliver: run clusterclip-k4-s0-abcd"),
                         ("", "the store is an empty string")):
        proc = python_m("ccexp.deliver", arg, "--tracking-uri", f"sqlite:///{tmp_path / 'target2.db'}", timeout=120,
                        cwd=tmp_path)
        assert message in proc.stdout + proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_c37_the_report_of_runs_without_held_out_metrics_and_the_ui_hint_are_one_line(tmp_path):
    from mlflow import MlflowClient

    from ccexp.compare.report import check_parent, write_report

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("ccexp-plan")
    r = client.create_run(exp, run_name="plan").info.run_id
    client.log_metric(r, "plan/tokens", 1.0)
    client.set_terminated(r)
    with pytest.raises(CcexpError, match=r"hold no held-out metric \(eval/ppl, ...\): nothing to compare"):
        write_report(client, out_dir=tmp_path / "report", experiment="ccexp-plan")
    with pytest.raises(CcexpError, match=r"is not a sweep's parent run; .* \(or omit --parent\)"):
        check_parent(client, r, "ccexp-plan", all_runs=False)


def test_c38_a_logger_whose_own_folder_or_first_write_fails_is_one_line_before_any_stage(tmp_path):
    from omegaconf import OmegaConf

    from ccexp.tracking.loggers import trial_start

    (tmp_path / "afile").write_text("x")
    tb = OmegaConf.create({"_target_": "lightning.pytorch.loggers.TensorBoardLogger", "save_dir": str(tmp_path),
                           "name": "afile"})
    with pytest.raises(CcexpError, match=r"logger.loggers.tb writes into .*afile/version_0, which cannot be made \(.*"
                                         r"afile is not a folder\)"):
        trial_start(tb, "logger.loggers.tb")
    long = OmegaConf.create({"_target_": "lightning.pytorch.loggers.TensorBoardLogger",
                             "save_dir": str(tmp_path / ("a" * 300))})
    with pytest.raises(CcexpError, match=r"save_dir=.* cannot be made \(File name too long\)"):
        trial_start(long, "logger.loggers.tb")
    csv_logger = OmegaConf.create({"_target_": "lightning.pytorch.loggers.CSVLogger",
                                   "save_dir": str(tmp_path / "csv"), "flush_logs_every_n_steps": 0})
    with pytest.raises(CcexpError, match=r"cannot start: ZeroDivisionError"):
        trial_start(csv_logger, "logger.loggers.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing left behind by the tries


def test_c40_every_user_file_refuses_wrong_types_and_shapes(tmp_path):
    from ccexp.data.corpus import CorpusReader
    from ccexp.sampling.dynamic import load_reference_losses
    from ccexp.sampling.mixture import mixture_weights

    dupcol = tmp_path / "dupcol.csv"
    dupcol.write_text("cluster,weight,weight\n0,1,0\n1,1,0\n2,1,0\n3,1,1\n")
    with pytest.raises(CcexpError, match=r"names the column 'weight' twice"):
        mixture_weights(str(dupcol), np.array([5, 5, 5, 5]))
    bad = tmp_path / "rl.json"
    bad.write_text('[true, false, true, "2.5"]')
    with pytest.raises(CcexpError, match=r"cluster 0's loss is True, not a number"):
        load_reference_losses(str(bad), 4)
    np.save(tmp_path / "rl.npy", np.array([True, False]))
    with pytest.raises(CcexpError, match=r"holds bool values"):
        load_reference_losses(str(tmp_path / "rl.npy"), 2)
    good = tmp_path / "ok.json"
    good.write_text("[1.5, 2, 3, 2.5]")
    assert load_reference_losses(str(good), None).tolist() == [1.5, 2.0, 3.0, 2.5]
    labels = tmp_path / "labels.jsonl"
    labels.write_text('{"id": "a", "text": "one", "domain": ["x", "y"]}\n')
    with pytest.raises(CcexpError, match=r"record 1 field 'domain' is a list \(\['x', 'y'\]\); a label is one value"):
        list(CorpusReader(path=str(labels), label_fields=["domain"]).batches(10))


def test_c40_doremi_with_losses_of_its_own_plans_and_trains(tmp_path):
    """A valid losses file for K = 4 was refused by the one-cluster stand-in of the budget check."""
    losses = tmp_path / "rl.json"
    losses.write_text("[1.5, 2, 3, 2.5]")
    proc = python_m("ccexp.plan", *small(tmp_path, "round4.jsonl", "train.steps=4"), "logger=none", "sampler=doremi",
                    f"sampler.reference_losses={losses}", timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_c42_a_file_given_as_two_sources_is_refused(tmp_path):
    from ccexp.data.sources import source_names

    corpus = CASES / "round4.jsonl"
    with pytest.raises(CcexpError, match=r"data.sources\[1\] and data.sources\[0\] read the same file"):
        source_names([{"path": str(corpus), "name": "x"}, {"path": str(corpus), "name": "y"}])
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(corpus.read_bytes())
    proc = run_ccexp("data=sources", "data.label_fields=[source,domain]", "clusterer.k=4", "logger=none",
                     f"data.sources=[{{path: {corpus}, name: x}},{{path: {copy}, name: y}}]",
                     f"paths.outputs={tmp_path / 'out'}", cwd=tmp_path)
    assert "holds the same bytes as data.sources[0]" in one_line(proc, 2)


def test_a_group_set_to_null_and_a_sharded_checkpoint_for_another_trainer_are_one_line(tmp_path):
    from ccexp.preflight import check_resume_from

    proc = run_ccexp("trainer=null", "--cfg", "job", cwd=tmp_path)
    assert one_line(proc, 2) == ("ccexp: error: trainer=null: a group needs one of its options (cpu, ddp, fsdp, gpu); "
                                 "drop trainer=null to keep the default")
    folder = tmp_path / "step-2.ckpt"
    folder.mkdir()
    (folder / "meta.pt").write_bytes(b"")
    with pytest.raises(CcexpError, match=r"is a sharded \(FSDP\) checkpoint folder; continue it with the FSDP trainer"):
        check_resume_from(str(folder), sharded=False)
    check_resume_from(str(folder), sharded=True)


def test_an_lm_eval_task_that_fails_keeps_the_others(tmp_path):
    from ccexp.data.tokenize import load_tokenizer
    from ccexp.evaluation.lm_eval_bridge import run_lm_eval
    from test_fsdp import tiny_llama
    from ccexp.training.models import hf_causal_lm

    folder = tiny_llama(tmp_path / "llama", hidden=32)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text(json.dumps({"text": "the cat sat"}) + "\n")
    for name, target in (("good_ppl", "{{text}}"), ("bad_ppl", "{{no_such_field}}")):
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'data.jsonl'}\n"
            f"test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{target}'\n"
            "metric_list:\n  - metric: word_perplexity\nmetadata:\n  version: 1.0\n")
    errors: dict = {}
    got = run_lm_eval(hf_causal_lm(str(folder)), load_tokenizer(folder), None, ["bad_ppl", "good_ppl"], batch_size=2,
                      max_length=64, include_path=str(tasks), errors=errors)
    assert "good_ppl/word_perplexity" in got and errors["lm_eval"].startswith("1 of 2 task(s) failed: bad_ppl (")
