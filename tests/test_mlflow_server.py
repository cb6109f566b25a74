"""A team's MLflow server (issue 30 §3, case c18), against a real ``mlflow server`` on 127.0.0.1 with a SQLite
backend and proxied artifacts: ``MLFLOW_TRACKING_URI`` is honoured (an explicit ``logger.tracking_uri`` wins),
a run, a parallel sweep, ``ccexp.plan``, ``ccexp.report`` and ``ccexp.ui`` go to (or read) the server; a server
down at start is one line before any stage; a server killed mid-run and restarted later, or answering 503 /
nothing in time to some calls, loses nothing — every metric, param, tag and artifact ends on the server,
compared value by value with the same run logged to a local store."""
from __future__ import annotations

import http.client
import http.server
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from warm import python_m
from conftest import ROOT

CASES = Path(__file__).parent / "cases"
# the cases' TINY (tests/test_cases.py), the loss logged every 2 steps (so a server can be killed mid-training)
TINY = ["debug=tiny", "data=jsonl", "data.label_fields=[domain]", "train.max_doc_tokens=64", "eval.max_tokens=63",
        f"data.path={CASES / 'tiny.jsonl'}", "train.log_every_n_steps=2"]
# MLflow's own retry settings, so a call to a server that is gone fails within seconds (not ~4 minutes)
QUICK_GIVE_UP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
VARYING = ("time/", "cache/", "train/tokens_per_s")  # the machine's speed, and what the stage cache held


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlflow server`` on 127.0.0.1: SQLite backend ``<root>/srv.db``, proxied artifacts in ``<root>/artifacts``."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_s: float = 300) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'srv.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port",
               str(self.port), "--workers", "1"]
        with open(self.root / "server.log", "ab") as log:  # its own process group: a kill takes its workers too
            self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=subprocess.DEVNULL, stderr=log,
                                         env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                                         start_new_session=True)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise AssertionError(f"mlflow server did not answer /health in {wait_s} s")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One stage cache for the module's runs (the corpus is embedded once)."""
    return tmp_path_factory.mktemp("cache")


def ccexp(out: Path, *args: str, env: dict | None = None, cache: Path | None = None, **popen):
    """``python -m ccexp`` on TINY as a user runs it (stdout and stderr as one stream, in order)."""
    flags = [a for a in args if a.startswith("-")]
    cmd = [sys.executable, "-m", "ccexp", *flags, *TINY, f"paths.outputs={out}",
           *([f"paths.cache={cache}"] if cache else []), *[a for a in args if not a.startswith("-")]]
    out.parent.mkdir(parents=True, exist_ok=True)
    kwargs = dict(cwd=out.parent, env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}, text=True,
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if popen.pop("background", False):
        return subprocess.Popen(cmd, **kwargs)
    return python_m(*cmd[2:], cwd=kwargs["cwd"], env=kwargs["env"], timeout=900, merge=True)


def tool(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return python_m(module, *args, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


def messages(text: str) -> list[str]:
    """The output's lines without the logging prefix (``[time][ccexp][INFO] - ``, ``[time][HYDRA] ``)."""
    return [re.sub(r"^\[[\d\-: ,]+\](\[[^\]]+\])*( - | )", "", ln) for ln in text.splitlines() if ln.strip()]


def documented(line: str, start: str) -> None:
    """``line`` is the row of docs/errors.md whose line starts with ``start`` (``<...>`` there: any text)."""
    spans = [s for s in re.findall(r"`([^`\n]+)`", (ROOT / "docs" / "errors.md").read_text()) if s.startswith(start)]
    assert len(spans) == 1, f"{len(spans)} rows of docs/errors.md start with {start!r}"
    pattern = "".join(".+?" if p.startswith("<") else re.escape(p) for p in re.split(r"(<[^<>]+>)", spans[0]))
    assert re.fullmatch(pattern, line), f"{line!r}\nis not the row of docs/errors.md:\n{spans[0]!r}"


def the_line(text: str, part: str) -> str:
    found = [m for m in messages(text) if part in m]
    assert len(found) == 1, f"{len(found)} lines with {part!r} in:\n{text[-4000:]}"
    return found[0]


def error_line(proc, code: int, prefix: str = "ccexp: error: ") -> str:
    text = proc.stdout + (proc.stderr or "")
    assert proc.returncode == code, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix.split(":")[0] + ":")]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert lines[0].startswith(prefix)
    return lines[0][len(prefix):]


def artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out += artifacts(client, run_id, f.path) if f.is_dir else [f.path]
    return sorted(out)


def snapshot(client, run_id: str) -> dict:
    """What a run holds: status, every metric's history (steps and values; steps only for the machine's times
    and the cache's reuse), params and tags (less the run's own folders), artifact files."""
    run = client.get_run(run_id)
    metrics = {}
    for key in run.data.metrics:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        metrics[key] = [s for s, _ in history] if key.startswith(VARYING) else history
    return {"status": run.info.status, "metrics": metrics,
            "params": {k: v for k, v in run.data.params.items() if not k.startswith(("paths.", "logger."))},
            "tags": {k: v for k, v in run.data.tags.items() if not k.startswith(("mlflow.", "run_dir"))},
            "artifacts": artifacts(client, run_id)}


def run_folder(out: Path) -> Path:
    (meta,) = out.glob("runs/*/*/run.json")
    return meta.parent


def run_id_of(out: Path) -> str:
    return json.loads((run_folder(out) / "run.json").read_text())["mlflow_run_id"]


@pytest.fixture(scope="module")
def reference(server, cache, tmp_path_factory):
    """The run the server's runs are compared with: TINY, logged to a local store by ``logger.tracking_uri``
    while ``MLFLOW_TRACKING_URI`` names the server. Returns (its process, its snapshot, the store's URI)."""
    root = tmp_path_factory.mktemp("reference")
    uri = f"sqlite:///{root / 'explicit.db'}"
    proc = ccexp(root / "out", f"logger.tracking_uri={uri}", env={"MLFLOW_TRACKING_URI": server.uri}, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc, snapshot(MlflowClient(uri), run_id_of(root / "out")), uri, root


def test_an_explicit_logger_tracking_uri_wins_over_MLFLOW_TRACKING_URI(reference, server):
    proc, snap, uri, root = reference
    first = messages(proc.stdout)[0]
    assert first == f"mlflow: tracking store {uri} (from logger.tracking_uri; MLFLOW_TRACKING_URI={server.uri} is not used)"
    documented(first, "mlflow: tracking store <uri> (from logger.tracking_uri;")
    assert snap["status"] == "FINISHED" and len(snap["metrics"]) > 50
    assert not (root / "out" / "mlflow.db").exists()
    exp = MlflowClient(server.uri).get_experiment_by_name("ccexp")  # nothing of it on the server
    assert exp is None or not MlflowClient(server.uri).search_runs(
        [exp.experiment_id], f"tags.run_dir LIKE '{root}%'")


def test_c18_MLFLOW_TRACKING_URI_names_the_store_the_run_goes_to(cache, tmp_path):
    envstore = tmp_path / "envstore"
    envstore.mkdir()
    proc = ccexp(tmp_path / "out", "train.steps=2", env={"MLFLOW_TRACKING_URI": f"sqlite:///{envstore}/mlflow.db"},
                 cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:]
    first = messages(proc.stdout)[0]
    assert first == f"mlflow: tracking store sqlite:///{envstore}/mlflow.db (from MLFLOW_TRACKING_URI)"
    documented(first, "mlflow: tracking store <uri> (from MLFLOW_TRACKING_URI)")
    client = MlflowClient(f"sqlite:///{envstore}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["train/tokens"] == 2 * 512
    assert not (tmp_path / "out" / "mlflow.db").exists()


def test_the_default_store_line_and_its_row(tmp_path, monkeypatch):
    from ccexp.tracking.mlflow_run import run_store

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    line = run_store(None, tmp_path).line()
    assert line.startswith(f"mlflow: tracking store sqlite:///{tmp_path}/mlflow.db (the default")
    documented(line, "mlflow: tracking store sqlite:///<outputs>/mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///rel/x.db")  # relative, as MLflow reads it: the cwd's
    monkeypatch.chdir(tmp_path)
    assert run_store(None, tmp_path / "out").uri == f"sqlite:///{tmp_path}/rel/x.db"


def test_a_run_with_MLFLOW_TRACKING_URI_has_every_param_metric_and_artifact_on_the_server(server, cache, reference,
                                                                                          tmp_path):
    proc = ccexp(tmp_path / "out", env={"MLFLOW_TRACKING_URI": server.uri}, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:]
    first = messages(proc.stdout)[0]
    assert first == f"mlflow: tracking store {server.uri} (from MLFLOW_TRACKING_URI)"
    documented(first, "mlflow: tracking store <uri> (from MLFLOW_TRACKING_URI)")
    out, folder = tmp_path / "out", run_folder(tmp_path / "out")
    assert not (out / "mlflow.db").exists() and not (out / "mlartifacts").exists()  # nothing went to a local store
    assert not (folder / "mlflow-local").exists()
    client, run_id = MlflowClient(server.uri), run_id_of(out)
    got = snapshot(client, run_id)
    assert got == reference[1]  # the same params, metric histories (values too), tags and artifacts
    assert got["status"] == "FINISHED" and len(got["metrics"]) > 50 and len(got["params"]) > 100
    assert {"tables/clusters.csv", "balance/balance.md", "balance/mix.png", "clusters/clusters.md"} <= \
        set(got["artifacts"])
    assert got["metrics"]["train/loss"][0][0] == 1 and len(got["metrics"]["train/loss"]) == 10  # every 2nd step
    # proxied artifacts: downloaded through the server, byte for byte the run folder's file, kept by the server
    for path in ("tables/clusters.csv", "balance/mix.png"):
        local = Path(client.download_artifacts(run_id, path, str(tmp_path / "dl")))
        assert local.read_bytes() == (folder / path).read_bytes()
    assert list((server.root / "artifacts").rglob(f"{run_id}/artifacts/tables/clusters.csv"))


def test_ccexp_plan_logs_to_the_server_MLFLOW_TRACKING_URI_names(server, tmp_path):
    proc = python_m("ccexp.plan", "plan.source=synthetic", "plan.clusters=4", "plan.documents=40", "train.steps=10",
                    f"paths.outputs={tmp_path / 'out'}", timeout=600, cwd=tmp_path,
                    env={**os.environ, "MLFLOW_TRACKING_URI": server.uri})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert messages(proc.stderr)[0] == f"mlflow: tracking store {server.uri} (from MLFLOW_TRACKING_URI)"
    client = MlflowClient(server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ccexp-plan").experiment_id])
    assert run.data.tags["ccexp.plan"] == "true" and "plan/kl_to_corpus" in run.data.metrics
    assert "plan.md" in [f.path for f in client.list_artifacts(run.info.run_id)]
    assert not (tmp_path / "out" / "mlflow.db").exists()


@pytest.mark.slow
def test_a_parallel_sweep_has_one_parent_and_its_children_on_the_server_and_report_and_ui_read_it(server, cache,
                                                                                                   tmp_path):
    env = {"MLFLOW_TRACKING_URI": server.uri}
    out = tmp_path / "out"
    proc = ccexp(out, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=3", "sampler=random,uniform,clusterclip",
                 env=env, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert messages(proc.stdout)[0] == f"mlflow: tracking store {server.uri} (from MLFLOW_TRACKING_URI)"
    (record,) = out.glob("multirun/*/*/sweep.json")
    sweep_dir, saved = record.parent, json.loads(record.read_text())
    assert saved["tracking_uri"] == server.uri and not (out / "mlflow.db").exists()
    client = MlflowClient(server.uri)
    parent = client.get_run(saved["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["ccexp.sweep"] == "true"
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["sampler"] for c in children) == ["clusterclip", "random", "uniform"]
    assert all(c.info.status == "FINISHED" and c.data.tags["run_dir"].startswith(str(sweep_dir)) for c in children)
    assert (sweep_dir / "report" / "report.md").is_file()
    assert "report/report.md" in artifacts(client, parent.info.run_id)
    # python -m ccexp.report with only the environment variable: the latest sweep on the server
    rep = tool("ccexp.report", "--out", str(tmp_path / "rep"), env=env)
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert rep.stderr.splitlines()[0] == f"ccexp.report: tracking store {server.uri} (from MLFLOW_TRACKING_URI)"
    documented(rep.stderr.splitlines()[0], "ccexp.report: tracking store <uri>")
    assert f"report: {tmp_path / 'rep' / 'report.md'}" in rep.stdout
    rows = (tmp_path / "rep" / "comparison.csv").read_text().splitlines()
    assert {r.split(",")[1] for r in rows[1:]} == {"clusterclip", "random", "uniform"}
    # python -m ccexp.ui on the server: the view in the server's own UI, served there
    ui = tool("ccexp.ui", "--tracking-uri", server.uri)
    assert ui.returncode == 0, ui.stderr[-3000:]
    lines = ui.stdout.splitlines()
    key = f"ccexp-{parent.info.run_id[:12]}"
    view = f"{server.uri}/#/experiments/{parent.info.experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning"
    assert lines[1] == view + "&compareRunsMode=CHART" and lines[3] == view  # the charts (verdicts), then the table
    assert lines[5] == (f"{server.uri}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
                        "?workflowType=machine_learning")  # the sweep's parent run, on the server too
    documented(lines[6], "ccexp.ui: the view is in the tracking server's own UI")
    assert "<html" in urllib.request.urlopen(lines[1].split("#")[0], timeout=30).read().decode().lower()
    got = json.load(urllib.request.urlopen(f"{server.uri}/ajax-api/2.0/mlflow/experiments/get?experiment_id="
                                           f"{parent.info.experiment_id}", timeout=30))
    tags = {t["key"]: t["value"] for t in got["experiment"]["tags"]}
    assert parent.info.run_id in json.loads(tags[f"mlflow.sharedViewState.{key}"])["searchFilter"]


def test_a_server_down_at_start_is_one_line_before_any_stage_or_job(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    env = {"MLFLOW_TRACKING_URI": dead}
    for args in ([], ["-m", "sampler=random,uniform"]):
        out = tmp_path / ("sweep" if args else "run")
        line = error_line(ccexp(out, *args, env=env), 2)
        documented(line, "the MLflow tracking server <uri> (from MLFLOW_TRACKING_URI) does not answer")
        assert dead in line and f"unset, the run logs to {out / 'mlflow.db'}" in line
        assert not (out / "cache").exists() and not (out / "mlflow.db").exists()  # no stage ran, no store made
        assert not list(out.glob("multirun/*/*/*/.hydra")) and not list(out.glob("multirun/*/*/sweep.json"))
    plan = tool("ccexp.plan", "plan.source=synthetic", "plan.clusters=4", "plan.documents=40",
                f"paths.outputs={tmp_path / 'plan'}", env=env)
    documented(error_line(plan, 2), "the MLflow tracking server <uri> (from MLFLOW_TRACKING_URI) does not answer")
    assert not (tmp_path / "plan" / "plans").exists()
    for module in ("ccexp.report", "ccexp.ui"):
        line = error_line(tool(module, env=env), 2, f"{module}: error: ")
        assert line.startswith(f"the MLflow tracking server {dead} (from MLFLOW_TRACKING_URI) does not answer")


class _Stub(http.server.BaseHTTPRequestHandler):
    status, body = 403, b"Forbidden"

    def do_GET(self):
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status,body,start", [
    (403, b"Forbidden", "the MLflow tracking server <uri> (from <setting>) refused"),
    (404, b"<html>Not Found</html>", "<uri> (from <setting>) is not an MLflow tracking server")])
def test_a_server_that_refuses_or_is_no_mlflow_server_is_one_line(status, body, start):
    from ccexp.errors import CcexpError
    from ccexp.tracking.store import Store, check_server

    handler = type("Stub", (_Stub,), {"status": status, "body": body})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(CcexpError) as e:
            check_server(Store(f"http://127.0.0.1:{httpd.server_port}", "logger.tracking_uri"))
    finally:
        httpd.shutdown()
    documented(str(e.value), start)


def loss_steps(client, out: Path) -> int:
    exp = client.get_experiment_by_name("ccexp")
    runs = client.search_runs([exp.experiment_id], f"tags.run_dir LIKE '{out}%'") if exp else []
    return len(client.get_metric_history(runs[0].info.run_id, "train/loss")) if runs else 0


def test_a_server_killed_mid_run_and_restarted_later_loses_nothing(server, cache, reference, tmp_path):
    out = tmp_path / "out"
    proc = ccexp(out, env={"MLFLOW_TRACKING_URI": server.uri, **QUICK_GIVE_UP}, cache=cache, background=True)
    client = MlflowClient(server.uri)
    try:
        deadline = time.monotonic() + 600
        while loss_steps(client, out) < 2:  # the losses of steps 1 and 3 are on the server: kill it mid-training
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        server.kill()
        text = proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, text[-3000:]  # the run went on and finished
        documented(the_line(text, "stopped answering"), "mlflow: the tracking server <uri> stopped answering")
        store = run_folder(out) / "mlflow-local"
        still = the_line(text, "is still away")
        documented(still, "mlflow: the tracking server <uri> is still away")
        command = still.split("deliver it with ")[1]
        assert command == f"python -m ccexp.deliver {store}"
        # the run's last metrics are in the local store it names
        local = MlflowClient(f"sqlite:///{store}/mlflow.db")
        (kept,) = local.search_runs([local.get_experiment_by_name("ccexp").experiment_id])
        assert kept.data.tags["ccexp.server_run_id"] == run_id_of(out) and "eval/ppl" in kept.data.metrics
        server.start()  # the same database and port: the command that line gave delivers the rest
        delivered = tool(*shlex.split(command)[2:])
        assert delivered.returncode == 0, delivered.stderr[-3000:]
        documented(delivered.stdout.strip(), "deliver: run <name> -> <run id> on <uri>:")
        assert snapshot(client, run_id_of(out)) == reference[1]  # everything, as if the server had never gone
        again = tool(*shlex.split(command)[2:])
        documented(again.stdout.strip(), "deliver: nothing to deliver in <store>")
    finally:
        if proc.poll() is None:
            proc.kill()
        if server.proc.poll() is not None:  # the module's other tests need it
            server.start()


def test_a_deliver_while_the_server_is_down_marks_nothing_and_says_so(tmp_path, monkeypatch, server):
    from ccexp.tracking.server import DELIVERED, FallbackClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead = f"http://127.0.0.1:{free_port()}"
    fb = FallbackClient(dead, tmp_path / "mlflow-local")
    run_id = fb.create_run("ccexp", "begun-while-away", {"sampler": "random"})
    fb.log_metric(run_id, "train/loss", 2.5, step=3)
    fb.set_terminated(run_id, "FINISHED")
    assert fb.close() is not None
    down = tool("ccexp.deliver", str(tmp_path), env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})  # the run folder works too
    documented("ccexp.deliver: error: " + error_line(down, 2, "ccexp.deliver: error: "),
               "ccexp.deliver: error: the MLflow tracking server <uri> (from the record of run <name>) does not answer")
    nothing = tool("ccexp.deliver", str(tmp_path / "nope"))
    documented("ccexp.deliver: error: " + error_line(nothing, 2, "ccexp.deliver: error: "),
               "ccexp.deliver: error: <folder> holds no local")
    with FaultyProxy(server.port, fail=10**6) as proxy:  # it answers, then 503 to every log-batch
        cut = tool("ccexp.deliver", str(tmp_path), "--tracking-uri", proxy.uri,
                   env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    documented("ccexp.deliver: error: " + error_line(cut, 2, "ccexp.deliver: error: "),
               "ccexp.deliver: error: the MLflow tracking server <uri> stopped answering while")
    local = MlflowClient(f"sqlite:///{tmp_path / 'mlflow-local' / 'mlflow.db'}")
    (run,) = local.search_runs([local.get_experiment_by_name("ccexp").experiment_id])
    assert DELIVERED not in run.data.tags  # nothing marked delivered: the next try goes on
    ok = tool("ccexp.deliver", str(tmp_path / "mlflow-local"), "--tracking-uri", server.uri)
    assert ok.returncode == 0, ok.stderr[-3000:]
    server_id = ok.stdout.split(" -> ")[1].split(" ")[0]
    got = MlflowClient(server.uri).get_run(server_id)  # a run begun while the server was away: created there
    assert got.info.run_name == "begun-while-away" and got.info.status == "FINISHED"
    assert got.data.metrics == {"train/loss": 2.5} and got.data.tags["sampler"] == "random"


def test_a_server_back_before_the_run_ends_gets_what_the_local_store_kept(server, tmp_path, monkeypatch, caplog):
    from ccexp.tracking.server import FallbackClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    caplog.set_level(logging.INFO, logger="ccexp")
    fb = FallbackClient(server.uri, tmp_path / "mlflow-local", probe_every_s=0.5)
    run_id = fb.create_run("ccexp", "comes-back", {"sampler": "uniform"})
    fb.log_param(run_id, "seed", "0")
    fb.log_metric(run_id, "train/loss", 5.0, step=1)
    server.kill()
    try:
        fb.log_metric(run_id, "train/loss", 4.0, step=3)  # the server is gone: into the local store
        fb.log_param(run_id, "train.steps", "20")
        fb.set_tag(run_id, "fingerprints", "corpus=abc")
        (tmp_path / "clusters.csv").write_text("cluster,size\n0,3\n")
        fb.log_artifact(run_id, str(tmp_path / "clusters.csv"), "tables")
        away = fb.create_run("ccexp", "begun-while-away", {"sampler": "random"})
        fb.log_metric(away, "train/loss", 6.0, step=1)
        assert fb.away in ("connection refused", "connection lost")  # a new connection, or the kept-alive one
    finally:
        server.start()  # the same database and port
    assert fb._back.wait(60)  # the probe saw it
    fb.log_metric(run_id, "train/loss", 3.0, step=5)  # this write delivers the local store first, then goes on
    assert fb.away is None
    documented(next(r.getMessage() for r in caplog.records if "stopped answering" in r.getMessage()),
               "mlflow: the tracking server <uri> stopped answering")
    documented(next(r.getMessage() for r in caplog.records if "answers again:" in r.getMessage()),
               "mlflow: the tracking server <uri> answers again")
    fb.set_terminated(run_id, "FINISHED")
    fb.set_terminated(away, "FINISHED")
    assert fb.close() is None  # nothing left in the local store
    client = MlflowClient(server.uri)
    run = client.get_run(run_id)
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")) == \
        [(1, 5.0), (3, 4.0), (5, 3.0)]
    assert run.data.params == {"seed": "0", "train.steps": "20"} and run.data.tags["fingerprints"] == "corpus=abc"
    assert run.info.status == "FINISHED" and artifacts(client, run_id) == ["tables/clusters.csv"]
    other = client.get_run(fb.server_run_id(away))
    assert other.info.run_name == "begun-while-away" and other.data.metrics == {"train/loss": 6.0}


def test_a_sweep_that_ends_while_the_server_is_away_keeps_its_parent_and_says_how_to_report(tmp_path, monkeypatch,
                                                                                              caplog):
    from omegaconf import OmegaConf

    from ccexp.tracking.server import FallbackClient
    from ccexp.launch.sweep import MlflowSweepCallback

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead = f"http://127.0.0.1:{free_port()}"
    callback = MlflowSweepCallback()
    callback.uri, callback.parent_id = dead, "0123456789abcdef0123456789abcdef"
    callback.client = FallbackClient(dead, tmp_path / "sweep" / "mlflow-local")
    callback.client.adopt(callback.parent_id, "ccexp", "sweep-x")
    callback._report(tmp_path / "sweep" / "report",
                     OmegaConf.create({"baseline": "random", "min_effect": 0.02, "power": 0.8, "primary": "eval/bpb"}))
    documented(next(r.getMessage() for r in caplog.records if r.getMessage().startswith("report:")),
               "report: the tracking server <uri> does not answer")
    callback.close("FINISHED")
    documented(next(r.getMessage() for r in caplog.records if "is still away" in r.getMessage()),
               "mlflow: the tracking server <uri> is still away")
    local = MlflowClient(f"sqlite:///{tmp_path / 'sweep' / 'mlflow-local' / 'mlflow.db'}")
    (run,) = local.search_runs([local.get_experiment_by_name("ccexp").experiment_id])
    assert run.info.run_name == "sweep-x" and run.info.status == "FINISHED"
    assert run.data.tags["ccexp.server_run_id"] == callback.client.server_run_id("0123456789abcdef0123456789abcdef")


class FaultyProxy:
    """A real HTTP proxy in front of the server: it forwards every request, but answers 503 to the first
    ``fail`` log-batch requests and, to the ``hold``-th, nothing for ``hold_s`` seconds (then drops it)."""

    def __init__(self, port: int, fail: int = 0, hold: int | None = None, hold_s: float = 0.0):
        self.port, self.fail, self.hold, self.hold_s = port, fail, hold, hold_s
        self.batches, self.faults, self._lock = 0, [], threading.Lock()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()

    def fault(self, method: str, path: str) -> str | None:
        if method != "POST" or not path.startswith("/api/2.0/mlflow/runs/log-batch"):
            return None
        with self._lock:
            self.batches += 1
            what = "503" if self.batches <= self.fail else "held" if self.batches == self.hold else None
            if what:
                self.faults.append((what, self.batches))
            return what

    def _handler(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while (size := int(self.rfile.readline().strip() or b"0", 16)) > 0:
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return data
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def handle_one(self):
                data = self.body()
                what = proxy.fault(self.command, self.path)
                if what == "held":  # no answer within the client's timeout, then the connection is dropped
                    time.sleep(proxy.hold_s)
                    self.close_connection = True
                    return
                if what == "503":
                    self.answer(503, [("Content-Type", "application/json")],
                                b'{"error_code": "TEMPORARILY_UNAVAILABLE", "message": "injected by the test"}')
                    return
                hop = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}
                conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=300)
                conn.request(self.command, self.path, body=data if data or self.command in ("POST", "PUT") else None,
                             headers={k: v for k, v in self.headers.items() if k.lower() not in hop})
                response = conn.getresponse()
                self.answer(response.status, [(k, v) for k, v in response.getheaders()
                                              if k.lower() not in hop | {"date", "server"}], response.read())
                conn.close()

            def answer(self, status: int, headers: list, payload: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = handle_one

        return Handler


def test_5xx_and_a_timeout_on_one_call_are_retried_and_lose_nothing(server, cache, reference, tmp_path):
    out = tmp_path / "out"
    with FaultyProxy(server.port, fail=2, hold=4, hold_s=8) as proxy:  # the run's timeout: 4 s
        proc = ccexp(out, env={"MLFLOW_TRACKING_URI": proxy.uri, "MLFLOW_HTTP_REQUEST_TIMEOUT": "4"}, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proxy.faults == [("503", 1), ("503", 2), ("held", 4)]  # each answered by a retry of MLflow's own
    assert "Retrying (Retry(" in proc.stdout and "Read timed out. (read timeout=4)" in proc.stdout  # urllib3's
    assert "stopped answering" not in proc.stdout and not (run_folder(out) / "mlflow-local").exists()
    assert snapshot(MlflowClient(server.uri), run_id_of(out)) == reference[1]


@pytest.mark.parametrize("transport, why", [
    (lambda: __import__("requests").exceptions.ChunkedEncodingError(http.client.IncompleteRead(b"")), "connection lost"),
    (lambda: http.client.RemoteDisconnected("Remote end closed connection without response"), "connection lost"),
    (lambda: __import__("requests").exceptions.ConnectionError("Connection refused"), "connection refused"),
    (lambda: __import__("requests").exceptions.ReadTimeout("read timed out"), "timed out"),
    (lambda: ValueError("a bug, not the server"), None),
])
def test_a_server_that_dies_in_the_middle_of_its_answer_has_gone_away(transport, why):
    """MLflow wraps the transport's error in its own (``API request ... failed with exception``): what the server's
    absence reads as is found in the chain, a cut answer (the server killed while it wrote) included; anything else
    is not called an absence."""
    from mlflow.exceptions import MlflowException

    from ccexp.tracking.store import unreachable

    try:
        try:
            raise transport()
        except Exception as inner:  # noqa: BLE001
            raise MlflowException(f"API request to http://127.0.0.1:1/api failed with exception {inner}")
    except MlflowException as wrapped:
        assert unreachable(wrapped) == why
