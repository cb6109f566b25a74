"""Round 4 of the team's ``shared/cases`` (c19-c31; c18 is in ``tests/test_mlflow_server.py``), each the kind of
fault it stands for, asserting the right behaviour. The cases share one 300-document corpus
(``tests/cases/round4.jsonl``, the cases' ``corpus.jsonl``)."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from ccexp.errors import CcexpError
from warm import python_m
from test_cases import CASES, ccexp, one_line

CORPUS = "round4.jsonl"


# -- c27: weights whose sum overflows ------------------------------------------------------------
def test_c27_weights_summing_to_inf_are_normalised_and_the_run_trains_on_them(tmp_path):
    """``sampler.weights=[1e308]*4``: the sum overflows a float; the weights are normalised by the largest first,
    so the mix is 0.25 each (never all zeros, never a traceback)."""
    proc = ccexp(tmp_path, CORPUS, "train.steps=2", "logger=none", "sampler=mixture",
                 "sampler.weights=[1e308,1e308,1e308,1e308]")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    line = re.search(r"mixture: cluster weights as token shares (.*) \((\d) of 4 clusters drawn\)", log)
    assert line and line.group(2) == "4" and line.group(1).count("0.250") == 4, log[-2000:]


def test_c27_every_weight_normalisation_survives_an_overflowing_sum():
    """The kind, everywhere weights are normalised: the mixture's, the source mixture's and data.sources'."""
    from ccexp.data.sources import source_weights
    from ccexp.sampling import MixtureSampler
    from ccexp.sampling.sources import normalise_source_weights
    from helpers import clustered_documents

    labels, sizes = clustered_documents([5, 5, 5])
    assert np.allclose(MixtureSampler(labels, sizes, weights=[1e308, 1e308, 0]).weights(), [0.5, 0.5, 0])
    assert np.allclose(MixtureSampler(labels, sizes, weights={0: 1e308, 2: 1.7e308}).weights(),
                       np.array([1, 0, 1.7]) / 2.7)
    assert np.allclose(normalise_source_weights([1e308, 1e308]), [0.5, 0.5])
    assert np.allclose(source_weights([{"path": "a", "weight": 1e308}, {"path": "b", "weight": 1e308}]), [0.5, 0.5])
    with pytest.raises(CcexpError, match="weight 0 is inf"):
        MixtureSampler(labels, sizes, weights=[float("inf"), 1, 1])


# -- c28: a weights file that is not UTF-8 ---------------------------------------------------------
def test_c28_a_weights_csv_that_is_not_utf8_is_one_line_naming_the_file_and_the_byte(tmp_path):
    proc = ccexp(tmp_path, CORPUS, "logger=none", "sampler=mixture", f"sampler.weights={CASES / 'weights-latin1.csv'}")
    line = one_line(proc, 2)
    assert "weights-latin1.csv' is not UTF-8 text (byte 0xe9 at offset 27); save it as UTF-8 CSV" in line
    assert not (tmp_path / "out" / "cache").exists()  # refused in pre-flight: no stage ran


@pytest.mark.parametrize("name,content,message", [
    ("w.csv", b"\x1f\x8b\x08\x00gzipped", "is not UTF-8 text (byte 0x8b at offset 1); save it as UTF-8 CSV"),
    ("w.csv", b"cluster,weight\n0,1\x00\n", "is '1\\x00', not a number"),
    ("w.json", b"[0.5, 0.5, \xff]", "is not UTF-8 text (byte 0xff at offset 11); save it as UTF-8 JSON"),
    ("bom.csv", "\ufeffcluster,weight\n0,1\n1,3\n2,0\n".encode(), None),  # Excel's UTF-8 CSV: read
])
def test_c28_every_weights_file_that_is_not_utf8_text_is_one_line(tmp_path, name, content, message):
    from ccexp.sampling import MixtureSampler
    from helpers import clustered_documents

    (tmp_path / name).write_bytes(content)
    labels, sizes = clustered_documents([5, 5, 5])
    if message is None:
        assert np.allclose(MixtureSampler(labels, sizes, weights=str(tmp_path / name)).weights(), [0.25, 0.75, 0])
        return
    with pytest.raises(CcexpError) as e:
        MixtureSampler(labels, sizes, weights=str(tmp_path / name))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_c28_reference_losses_and_a_run_folder_that_are_not_utf8_are_one_line(tmp_path):
    from ccexp.sampling import MixtureSampler
    from ccexp.sampling.dynamic import load_reference_losses
    from helpers import clustered_documents

    (tmp_path / "ref.json").write_bytes(b"[1.0, \xe9]")
    with pytest.raises(CcexpError, match=r"ref.json'.* is not UTF-8 text \(byte 0xe9 at offset 6\)"):
        load_reference_losses(str(tmp_path / "ref.json"), 2)
    (tmp_path / "run" / "tables").mkdir(parents=True)
    (tmp_path / "run" / "tables" / "clusters.csv").write_bytes(b"cluster,train_size,average_weight\n0,5,0.\xe9\n")
    labels, sizes = clustered_documents([5])
    with pytest.raises(CcexpError, match="clusters.csv' is not UTF-8 text"):
        MixtureSampler(labels, sizes, weights=str(tmp_path / "run"))


# -- c31: a run folder of the same clustering is not "another clustering" ----------------------------
def _run_folder(tmp_path, sizes):
    from ccexp.evaluation.balance import write_cluster_table

    k = len(sizes)
    return write_cluster_table(tmp_path / "run" / "tables" / "clusters.csv", sizes=np.asarray(sizes),
                               exposure=np.asarray(sizes), loss_sum=np.ones(k), loss_tokens=np.full(k, 10),
                               average_weights=np.full(k, 1 / k),
                               per_cluster={"documents": np.ones(k, int), "tokens": np.ones(k, int),
                                            "ppl": np.ones(k)}).parent.parent


def test_c31_only_the_real_clustering_is_compared_with_a_run_folders(tmp_path, caplog):
    """Pre-flight's stand-in (one document per cluster) is no clustering to compare with: it says nothing; the
    run's sampler over the same clusters says nothing; over other clusters it warns, as before."""
    from ccexp import config, preflight
    from ccexp.sampling import MixtureSampler
    from helpers import clustered_documents

    folder = _run_folder(tmp_path, [40, 30, 20, 10])
    caplog.set_level(logging.WARNING, logger="ccexp")
    preflight._check_components(config.compose(["sampler=mixture", f"sampler.weights={folder}", "clusterer.k=4"]))
    labels, sizes = clustered_documents([40, 30, 20, 10])
    MixtureSampler(labels, sizes, weights=str(folder), document_tokens=np.full(labels.size, 9))
    assert "other training sizes" not in caplog.text
    labels, sizes = clustered_documents([40, 30, 21, 9])
    MixtureSampler(labels, sizes, weights=str(folder), document_tokens=np.full(labels.size, 9))
    assert "2 of the 4 clusters of" in caplog.text and "another corpus or clustering" in caplog.text


# -- c23: a run a callback stops early is not complete ------------------------------------------------
@pytest.mark.slow
def test_c23_a_run_the_timer_stops_is_incomplete_with_one_line_and_its_metrics_at_the_step_reached(tmp_path):
    """``callbacks=timer`` stops a 300-step run after a second: one line naming the step reached and how to
    continue, exit 75, the MLflow run KILLED (tagged incomplete) with its held-out metrics at the step reached."""
    from test_cases import runs

    proc = ccexp(tmp_path, CORPUS, "train.steps=300", "sampler=random", "callbacks=timer",
                 "callbacks.timer.duration=00:00:00:01")
    line = one_line(proc, 75)
    step = int(re.search(r"stopped by callbacks.LaunchTimer after step (\d+) of 300", line).group(1))
    assert 0 < step < 300 and "train.resume_from=" in line and "not complete" in line
    client, (run,) = runs(tmp_path / "out")
    assert run.info.status == "KILLED" and run.data.tags["incomplete"] == f"step {step} of 300"
    assert client.get_metric_history(run.info.run_id, "eval/ppl")[-1].step == step


def test_c23_the_timer_budget_is_per_launch():
    """A resumed run gets the timer's whole duration again (Lightning's Timer restored the elapsed time, so a
    run it stopped could never continue)."""
    from ccexp.training.callbacks import LaunchTimer

    timer = LaunchTimer(duration="00:00:01:00", interval="step")
    timer.load_state_dict({"time_elapsed": {"train": 3600.0, "sanity_check": 0.0, "validate": 0.0, "test": 0.0,
                                            "predict": 0.0}})
    assert timer.time_remaining("train") == pytest.approx(60.0, abs=1.0)


@pytest.mark.slow
def test_c23_a_run_stopped_by_a_callback_resumes_to_the_end_as_an_uninterrupted_run(tmp_path, monkeypatch):
    """A callback that stops training after 7 steps of every launch (``helpers.StopAfterSteps``, the timer's
    deterministic stand-in): each launch exits 75 further along, the same command with ``train.resume_from=last``
    continues the same MLflow run, and the last launch ends FINISHED at step 20 with exactly the held-out metrics
    of a run that was never stopped."""
    from conftest import ROOT
    from test_cases import runs

    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))  # the jobs import helpers.StopAfterSteps
    (tmp_path / "whole").mkdir()
    whole = ccexp(tmp_path / "whole", CORPUS, "sampler=random")
    assert whole.returncode == 0, whole.stderr[-3000:]
    stop = ["sampler=random", "+callbacks.stop._target_=helpers.StopAfterSteps", "+callbacks.stop.steps=7"]
    reached = []
    for launch in range(4):
        proc = ccexp(tmp_path, CORPUS, *stop, *(["train.resume_from=last"] if launch else []))
        if proc.returncode == 0:
            break
        reached.append(int(re.search(r"stopped by a callback after step (\d+) of 20", one_line(proc, 75)).group(1)))
    assert proc.returncode == 0 and reached == [7, 14], (reached, proc.stderr[-2000:])
    client, (run,) = runs(tmp_path / "out")  # one MLflow run, continued by each launch
    _, (ref,) = runs(tmp_path / "whole" / "out")
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "2"
    assert client.get_metric_history(run.info.run_id, "eval/ppl")[-1].step == 20
    for key in ("eval/ppl", "eval/ppl_macro", "train/tokens"):
        assert run.data.metrics[key] == ref.data.metrics[key], key


# -- c30: debug=overfit resumes on the same repeated batch -------------------------------------------
@pytest.mark.slow
def test_c30_an_overfit_run_resumed_from_its_step_10_checkpoint_ends_as_the_uninterrupted_run(tmp_path):
    """``debug=overfit`` repeats one micro-batch; a run resumed from its step-10 checkpoint must repeat the
    same one (step 1's, saved in the checkpoint), so its steps 11-20 and its held-out metrics equal the run that
    was never stopped (it repeated step 11's batch before)."""
    from test_cases import runs

    args = ["debug=overfit", "train.steps=20", "train.checkpoint_every_n_steps=10"]
    (tmp_path / "a").mkdir()
    whole = ccexp(tmp_path / "a", CORPUS, *args)
    assert whole.returncode == 0, whole.stderr[-3000:]
    (ckpt,) = (tmp_path / "a" / "out").glob("runs/*/*/checkpoints/step-10.ckpt")
    (tmp_path / "b").mkdir()
    resumed = ccexp(tmp_path / "b", CORPUS, *args, f"train.resume_from={ckpt}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client_a, (a,) = runs(tmp_path / "a" / "out")
    client_b, (b,) = runs(tmp_path / "b" / "out")
    for key in ("eval/ppl", "eval/ppl_macro"):
        assert a.data.metrics[key] == b.data.metrics[key], key
    loss = {m.step: m.value for m in client_a.get_metric_history(a.info.run_id, "train/loss")}
    again = {m.step: m.value for m in client_b.get_metric_history(b.info.run_id, "train/loss")}
    assert again and all(loss[s] == v for s, v in again.items()), (loss, again)


# -- c26: synthetic plans for every K <= N, one line for a bad spread --------------------------------
@pytest.mark.parametrize("k,n", [(50, 60), (10_000, 20_000), (7, 7), (1, 1), (3, 1000)])
def test_c26_synthetic_sizes_are_positive_and_sum_to_n_for_every_k_up_to_n(k, n):
    from ccexp.data.simulate import synthetic_corpus

    labels, sizes, lengths = synthetic_corpus(k, n, zipf=1.0)
    assert sizes.size == k and sizes.min() >= 1 and sizes.sum() == n == labels.size == lengths.size
    assert np.all(np.diff(sizes) <= 1)  # still Zipf-ordered (up to one document of rounding)


def test_c26_a_plan_near_k_equals_n_runs_and_a_negative_spread_is_one_line(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    base = [sys.executable, "-m", "ccexp.plan", "plan.source=synthetic", "train.steps=10", "train.tokens_per_step=512",
            "train.seq_len=64", "train.micro_batch_size=8", "sampler=random", "logger=none",
            f"paths.outputs={tmp_path}"]
    ok = subprocess.run([*base, "plan.clusters=50", "plan.documents=60"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-2000:]
    for setting, line in [("plan.sigma=-1", "plan.sigma=-1.0 is out of range; it must be >= 0"),
                          ("plan.zipf=-0.5", "plan.zipf=-0.5 is out of range; it must be >= 0"),
                          ("plan.mean_tokens=0", "plan.mean_tokens=0.0 is out of range; it must be >= 1")]:
        bad = subprocess.run([*base, "plan.clusters=10", "plan.documents=1000", setting], capture_output=True,
                             text=True, cwd=ROOT)
        assert one_line(bad, 2) == f"ccexp: error: {line}"


# -- c19: a damaged store that holds runs is not taken for an empty one -------------------------------
def _damaged_store(db):
    """A store of 20 finished runs cut to its first half, as a cut-short copy leaves it."""
    import os

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    experiment = client.create_experiment("ccexp")
    for i in range(20):
        run = client.create_run(experiment, run_name=f"earlier-run-{i:02d}").info.run_id
        for step in range(50):
            client.log_metric(run, "eval/ppl", 100.0 - step, step=step)
        client.set_terminated(run, "FINISHED")
    from ccexp.tracking.store import _forget_engine

    _forget_engine(f"sqlite:///{db}")
    os.truncate(db, db.stat().st_size // 2)
    return db.read_bytes()


def test_c19_a_damaged_store_that_may_hold_runs_is_refused_in_one_line_and_left_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    before = _damaged_store(out / "mlflow.db")
    line = one_line(ccexp(tmp_path, CORPUS, "train.steps=2"), 2)
    assert f"the MLflow store {out / 'mlflow.db'} cannot be opened (" in line and "may hold runs; restore it " \
        "from a copy, or set logger.tracking_uri to a new store" in line
    assert (out / "mlflow.db").read_bytes() == before and not list(out.glob("mlflow.db.half-created-*"))
    assert not (out / "cache").exists()  # refused before any stage


@pytest.mark.parametrize("tool", ["ccexp.report", "ccexp.ui"])
def test_c19_the_readers_of_a_damaged_store_say_so_in_one_line(tmp_path, tool):
    db = tmp_path / "mlflow.db"
    before = _damaged_store(db)
    proc = python_m(tool, "--store", str(db), *(["--no-server"] if tool == "ccexp.ui" else []), cwd=tmp_path,
                    timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"{tool}: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "cannot be opened (" in errors[0] and "may hold runs" in errors[0]
    assert db.read_bytes() == before


def test_c19_only_a_store_shown_to_hold_no_run_counts_as_empty(tmp_path):
    import shutil
    import sqlite3

    from ccexp.tracking.store import _runs_in

    assert _runs_in(CASES / "half-created-mlflow.db") == (0, "")  # its migration cut short: readable, no run
    _damaged_store(tmp_path / "cut.db")
    assert _runs_in(tmp_path / "cut.db")[0] is None  # damaged: cannot be told
    (tmp_path / "noise.db").write_bytes(b"not a database at all" * 100)
    assert _runs_in(tmp_path / "noise.db") == (None, "file is not a database")
    shutil.copy(CASES / "half-created-mlflow.db", tmp_path / "two.db")
    with sqlite3.connect(tmp_path / "two.db") as con:
        con.execute("drop table runs")
        con.execute("create table runs (run_uuid text)")
        con.executemany("insert into runs values (?)", [("a",), ("b",)])
    assert _runs_in(tmp_path / "two.db") == (2, "")


def _store_contents(db: Path):
    """A SQLite MLflow store's schema, schema version and experiments, as MLflow reads them. A statement's
    lines are compared as a set: MLflow's own migrations write the runs table's CHECK constraints in an order
    that changes with the process's hash seed (two stores MLflow made with PYTHONHASHSEED 1 and 2 differ)."""
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(db)) as con:
        return (sorted((kind, name, table, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                       for kind, name, table, sql in con.execute("select type, name, tbl_name, sql from sqlite_master")),
                con.execute("select version_num from alembic_version").fetchall(),
                con.execute("select experiment_id, name, artifact_location, lifecycle_stage from experiments")
                .fetchall())


def test_a_store_made_from_the_schema_template_is_the_store_mlflow_makes_without_migrating(tmp_path, monkeypatch):
    import mlflow.store.db.utils
    from mlflow import MlflowClient

    from ccexp.tracking.store import open_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: the same for both stores
    MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments(max_results=1)
    open_store(f"sqlite:///{tmp_path / 'first.db'}")  # makes the template
    (template,) = (tmp_path / "cache" / "ccexp" / "mlflow-store").glob(f"mlflow-{mlflow.__version__}-schema-*.db")
    made = []
    monkeypatch.setattr(mlflow.store.db.utils, "_initialize_tables", made.append)  # migrating now: recorded
    client = open_store(f"sqlite:///{tmp_path / 'copied.db'}")
    assert made == [] and _store_contents(tmp_path / "copied.db") == _store_contents(tmp_path / "mlflow.db")
    run = client.create_run(client.create_experiment("e")).info.run_id
    client.log_metric(run, "m", 1.5)
    assert client.get_run(run).data.metrics == {"m": 1.5}
    assert not list(tmp_path.glob(".*copying")) and not list(template.parent.glob(".*making"))


def test_a_template_mlflow_cannot_open_or_a_cache_that_cannot_be_written_leaves_mlflow_to_make_the_store(
        tmp_path, monkeypatch):
    from ccexp.tracking.store import open_store

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")  # not a folder: no template can be made
    open_store(f"sqlite:///{tmp_path / 'one.db'}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    open_store(f"sqlite:///{tmp_path / 'two.db'}")
    (template,) = (tmp_path / "cache" / "ccexp" / "mlflow-store").glob("*.db")
    template.write_bytes(b"not a database" * 100)  # damaged in the cache
    client = open_store(f"sqlite:///{tmp_path / 'three.db'}")
    assert [e.name for e in client.search_experiments()] == ["Default"]
    assert _store_contents(tmp_path / "one.db") == _store_contents(tmp_path / "three.db")
    assert _store_contents(template)[2] == []  # dropped and made anew: an empty store again


# -- c20: a callback that needs a logger, in a run without one ----------------------------------------
@pytest.mark.parametrize("callback,cls", [("lr_monitor", "LearningRateMonitor"), ("device_stats", "DeviceStatsMonitor")])
def test_c20_a_callback_that_writes_to_a_logger_without_one_is_one_line_before_any_stage(tmp_path, callback, cls):
    line = one_line(ccexp(tmp_path, CORPUS, "logger=none", f"callbacks={callback}"), 2)
    assert line == (f"ccexp: error: callbacks.{callback} ({cls}) writes to a logger and logger=none has none; use "
                    "logger=mlflow or logger=tensorboard, or drop the callback (callbacks=none)")
    assert not (tmp_path / "out" / "cache").exists()  # pre-flight: no stage ran


# -- c25: data.max_documents over several sources ----------------------------------------------------
def test_c25_max_documents_subsamples_the_corpus_of_all_sources_together(tmp_path):
    import json

    from conftest import run_ccexp

    rows = [json.loads(line) for line in (CASES / CORPUS).read_text().splitlines()]
    paths = []
    for domain in ("cooking", "astronomy", "finance"):  # 151, 90 and 44 documents
        paths.append(tmp_path / f"{domain}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in rows if r["domain"] == domain))
    sources = "[" + ", ".join(f"{{path: {p}}}" for p in paths) + "]"
    proc = run_ccexp("debug=tiny", "data=sources", "data.max_documents=50", "data.label_fields=[source,domain]",
                     f"data.sources={sources}", "train.max_doc_tokens=64", "eval.max_tokens=63", "logger=none",
                     "train.steps=2", f"paths.outputs={tmp_path / 'out'}", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"corpus: 50 docs \(\d+ held out\)", proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
    from ccexp.data.store import open_corpus

    corpus = open_corpus(next((tmp_path / "out" / "cache" / "corpus").glob("[!.]*")))
    sources_kept = {i.split("/")[0] for i in corpus.ids}
    assert len(corpus.ids) == 50 and sources_kept == {"cooking", "astronomy", "finance"}


def test_c25_the_subsample_of_several_sources_is_the_subsample_of_their_union():
    """The kind: one subsample over the corpus, whatever the split into sources (ids ``<source>/<id>``)."""
    from ccexp.data.corpus import CorpusBatch, id_hash, subsample

    ids = [f"s{i % 3}/d{i}" for i in range(500)]

    def read(warn, size=64):
        for start in range(0, len(ids), size):
            part = ids[start:start + size]
            yield CorpusBatch(list(part), [f"text {i}" for i in part], {"source": [i[:2] for i in part]}, None)

    kept = [i for b in subsample(read, 120, 50) for i in b.ids]
    smallest = set(np.array(ids)[np.argsort(id_hash(ids, "subsample"), kind="stable")[:120]])
    assert len(kept) == 120 and set(kept) == smallest and kept == [i for i in ids if i in smallest]
    assert [len(b.ids) for b in subsample(read, 120, 50)] == [50, 50, 20]


# -- c29: ccexp.ui on a port another server holds ------------------------------------------------------
def test_c29_ui_on_a_port_another_server_answers_is_one_line_and_starts_nothing(tmp_path, capsys):
    """Another HTTP server answering ``/health`` with 200 on the port (as a ccexp.ui left open for another store
    does): the UI must not take it for its own server, print an address and exit later without a word."""
    import http.server
    import threading

    import socket

    from test_ui import sweep_store

    from ccexp.ui import default_host, main

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in default_host() else socket.AF_INET

    other = Server((default_host(), 0), Health)  # where ccexp.ui serves by default
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    sweep_store(tmp_path)
    try:
        with pytest.raises(SystemExit) as e:
            main(["--store", str(tmp_path / "mlflow.db"), "--port", str(port)])
    finally:
        other.shutdown()
        other.server_close()
    captured = capsys.readouterr()
    assert e.value.code == 2 and "MLflow UI running" not in captured.out and "http://" not in captured.out
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("ccexp.ui: error:")]
    assert errors == [f"ccexp.ui: error: port {port} on {default_host()} is in use (Address already in use): another "
                      "server (an earlier ccexp.ui?) listens there; stop it, or pass --port with a free port"]


# -- c24: a sweep extended with another setting ------------------------------------------------------
def test_c24_a_sweep_extended_with_another_setting_compares_one_configuration_and_names_the_rest(tmp_path):
    sweep = tmp_path / "out" / "multirun" / "sweep"
    args = ("-m", "train.steps=6", "sampler=random,uniform", f"hydra.sweep.dir={sweep}")
    first = ccexp(tmp_path, CORPUS, *args, "seed=0")
    assert first.returncode == 0, first.stderr[-3000:]
    second = ccexp(tmp_path, CORPUS, *args, "seed=0,1", "train.lr=0.001")  # the same folder, another train.lr
    assert second.returncode == 0, second.stderr[-3000:]
    report = (sweep / "report" / "report.md").read_text()
    assert report.startswith("# ccexp comparison: 4 runs of sweep ") and "(runs of other settings left out: see " \
        "the note)" in report.splitlines()[0]
    assert "report: 2 run(s) left out" in second.stdout + second.stderr  # said where the sweep ends, too
    row = next(line for line in report.splitlines() if line.startswith("| eval/ppl_macro |"))
    assert row.count("(n=2)") == 2  # each arm: seeds 0 and 1 at train.lr=0.001 only
    notes = [line for line in report.splitlines() if line.startswith("Note: 2 run(s) left out")]
    assert len(notes) == 1 and "(train.lr=0.002 where the newest run has 0.001)" in notes[0]
    assert re.search(r"random-\S+-s0-\S+, uniform-\S+-s0-\S+; they are not averaged", notes[0])


def test_c24_one_configuration_keeps_the_newest_runs_settings_per_arm(tmp_path):
    """The kind, on a real store: runs that differ in a shared setting or in their own arm's settings are left
    out; seeds and where a run is recorded are not configuration."""
    from mlflow import MlflowClient

    from ccexp.compare.report import one_configuration

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("ccexp")

    def run(name, sampler, **params):
        r = client.create_run(exp, run_name=name, tags={"sampler": sampler}).info.run_id
        for k, v in {"sampler.name": sampler, "train.lr": "0.001", "sampler.clip_threshold": "2", **params}.items():
            client.log_param(r, k, v)
        client.set_terminated(r)
        return name

    run("old-lr", "random", seed="0", **{"train.lr": "0.002"})
    run("old-clip", "clusterclip", seed="0", **{"sampler.clip_threshold": "5"})
    kept = [run(f"{s}-s{i}", s, seed=str(i), **{"paths.outputs": f"/o{i}", "train.init_seed": str(i)})
            for i in range(2) for s in ("random", "clusterclip")]
    runs = client.search_runs([exp], max_results=100)
    mine, notes = one_configuration(runs, "sampler")
    assert sorted(r.info.run_name for r in mine) == sorted(kept)
    assert len(notes) == 1 and notes[0].startswith("2 run(s) left out") and "old-clip, old-lr" in notes[0]
    assert "sampler.clip_threshold=5 where the newest run has 2" in notes[0] and "train.lr=0.002" in notes[0]
    assert one_configuration(mine, "sampler") == (mine, [])


# -- train.passes that derives billions of steps --------------------------------------------------------
def test_train_passes_that_derive_more_than_a_million_steps_are_one_line_before_embedding(tmp_path):
    line = one_line(ccexp(tmp_path, CORPUS, "logger=none", "train.passes=1e9"), 2)
    assert re.fullmatch(r"ccexp: error: train\.passes=1e\+09 over the [\d,]+ tokens of \d+ training documents is "
                        r"[\d,]+ steps of 512 tokens, more than 1,000,000; give fewer passes, or set train\.max_steps "
                        r"to the steps to run", line), line
    assert not list((tmp_path / "out" / "cache").glob("embed/*"))  # before any embedding
    capped = ccexp(tmp_path, CORPUS, "logger=none", "train.passes=1e9", "train.max_steps=2")  # asked for: it runs
    assert capped.returncode == 0 and "(capped by train.max_steps" in capped.stdout + capped.stderr, capped.stderr[-2000:]


# -- a sweep value that is not an option --------------------------------------------------------------
@pytest.mark.parametrize("values,line", [
    ("sampler=random,nope", "the sweep's value sampler=nope is not an option: In 'config': Could not find "
                            "'sampler/nope' Available options in 'sampler': "),
    ("sampler.clip_treshold=2,3", "Could not override 'sampler.clip_treshold'"),
])
def test_every_value_of_a_sweep_list_is_checked_before_any_job(tmp_path, values, line):
    proc = ccexp(tmp_path, CORPUS, "-m", "logger=none", "sampler=clusterclip", values, "seed=range(0,40)")
    found = one_line(proc, 2)
    assert line in found, found
    assert not (tmp_path / "out").exists()  # no job folder, no stage


def test_a_plan_checks_every_value_before_any_stage(tmp_path):
    import subprocess
    import sys

    from test_cases import TINY

    proc = python_m("ccexp.plan", *TINY, f"data.path={CASES / CORPUS}", "logger=none",
                    f"paths.outputs={tmp_path / 'out'}", "sampler=random,nope", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "the sweep's value sampler=nope is not an option" in proc.stderr
    assert not (tmp_path / "out" / "cache").exists()  # nothing embedded before it was found


def test_a_sweep_list_of_an_appended_misspelt_key_or_an_out_of_range_value_is_refused_before_any_job(tmp_path):
    proc = ccexp(tmp_path, CORPUS, "-m", "logger=none", "sampler=random,uniform", "+train.lrr=0.1,0.2")
    assert "the sweep's value" not in (line := one_line(proc, 2)) and "train.lrr is not a setting of train; did " \
        "you mean train.lr?" in line
    line = one_line(ccexp(tmp_path, CORPUS, "-m", "logger=none", "train.steps=3,2,0,4"), 2)
    assert "the sweep's value train.steps=0 is not an option: train.steps=0 is out of range; it must be >= 1" in line
    assert not (tmp_path / "out").exists()


def test_c29_localhost_counts_every_loopback_address_and_a_bad_host_or_port_is_one_line(tmp_path, capsys):
    import http.server
    import socket
    import threading

    from test_ui import sweep_store

    from ccexp.ui import main

    sweep_store(tmp_path)
    store = ["--store", str(tmp_path / "mlflow.db")]
    for args, message in ((["--host", "nosuch.invalid"], "--host nosuch.invalid: not a name or address this machine "
                                                         "can resolve"),):
        with pytest.raises(SystemExit) as e:
            main(store + args)
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(store + ["--port", "70000"])
    assert e.value.code == 2 and "argument --port: 70000 is not a TCP port; use 1-65535" in capsys.readouterr().err

    class V6(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6

    try:
        other = V6(("::1", 0), http.server.SimpleHTTPRequestHandler)  # another server on localhost's IPv6 address
    except OSError:
        pytest.skip("no IPv6 loopback here")
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SystemExit) as e:
            main(store + ["--host", "localhost", "--port", str(other.server_address[1])])
    finally:
        other.shutdown()
        other.server_close()
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"port {other.server_address[1]} on ::1 is in use" in err


def test_c19_a_store_a_run_cannot_write_is_one_line_in_preflight(tmp_path):
    import os
    import subprocess

    from mlflow import MlflowClient

    out = tmp_path / "out"
    out.mkdir()
    db = out / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()  # a sound, empty store
    before = db.read_bytes()
    if os.geteuid() == 0:  # root writes through permissions: make the file immutable instead
        if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported on this file system")
        undo = ["chattr", "-i", str(db)]
    else:
        db.chmod(0o444)
        undo = ["chmod", "644", str(db)]
    try:
        line = one_line(ccexp(tmp_path, CORPUS, "train.steps=2"), 2)
    finally:
        subprocess.run(undo, check=True)
    assert line.startswith(f"ccexp: error: the MLflow store {db} cannot be written (") and line.endswith(
        "make it writable, or set logger.tracking_uri to another store")
    assert db.read_bytes() == before and not (out / "cache").exists()


# -- a finished run's last.ckpt is its final step ------------------------------------------------------
@pytest.mark.parametrize("args,files", [(("train.steps=12", "train.checkpoint_every_n_steps=5"),
                                         ["last.ckpt", "step-10.ckpt", "step-5.ckpt"]),
                                        (("train.steps=4",), ["last.ckpt"])])
def test_a_finished_run_leaves_its_final_state_in_last_ckpt_and_nothing_else(tmp_path, args, files):
    import torch

    proc = ccexp(tmp_path, CORPUS, "logger=none", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (folder,) = (tmp_path / "out" / "runs").glob("*/*/checkpoints")
    assert sorted(p.name for p in folder.iterdir()) == files  # no last-v1.ckpt beside it
    steps = int(args[0].split("=")[1])
    assert torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == steps
