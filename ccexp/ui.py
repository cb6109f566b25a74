"""``python -m ccexp.ui``: the MLflow UI on ccexp's store, opened at the view that compares a sweep.

The MLflow UI's root page opens in its GenAI mode and its runs table shows no metric until columns are
picked. This command starts ``mlflow server`` on the store (``--store``, ``MLFLOW_TRACKING_URI``, else
``outputs/mlflow.db``; on a tracking server it starts nothing: the view opens in the server's own UI) and prints
one address: the runs of the latest sweep (or ``--parent``), grouped by sampler with each group's mean on
its own row, the headline held-out metrics as the columns (overall, macro, worst-cluster, rarest and
commonest quintile perplexity, bits per byte) and the runs sorted by macro perplexity. The view is an
MLflow *shared view* (an experiment tag ``mlflow.sharedViewState.<key>``, the same thing the UI's own
"share" writes), so the address keeps working for anyone who opens that store's UI.

Usage:
    python -m ccexp.ui                                   # outputs/mlflow.db on http://[::1]:5000 (127.0.0.1 without IPv6)
    python -m ccexp.ui --store runs/mlflow.db --port 5001 --parent <sweep run id>
    python -m ccexp.ui --no-server                       # write the view, print its address (a UI runs already)
    python -m ccexp.ui --tracking-uri http://mlflow.example:5000   # a team's server: the view in its own UI
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request

from ccexp.errors import CcexpError

SHARED_VIEW = "mlflow.sharedViewState."  # the MLflow UI's tag prefix for a shared view


def compare_view(client, experiment: str = "ccexp", parent: str | None = None) -> tuple[str, str, list[str]]:
    """Write the shared view that compares a sweep's runs: ``(experiment id, share key, metric columns)``.

    Args:
        client: an ``mlflow.MlflowClient`` on the store.
        experiment: the MLflow experiment's name.
        parent: the sweep's parent run id; None: the latest sweep of ``experiment``, or every run of the
            experiment when it has no sweep.

    Raises:
        CcexpError: when the experiment does not exist or holds no run.
    """
    from ccexp.evaluation.heldout import HEADLINE_KEYS, is_headline_key
    from ccexp.compare.report import HEADLINE, check_parent, latest_sweep, require_experiment
    from ccexp.compare.verdict import PRIMARY

    exp = require_experiment(client, experiment)
    if parent is None:
        try:
            parent = latest_sweep(client, experiment)
        except CcexpError:
            parent = None  # no sweep: compare every run of the experiment
    else:
        check_parent(client, parent, experiment, client.tracking_uri, all_runs=False)
    where = (f"tags.`mlflow.parentRunId` = '{parent}' and " if parent else "") + "attributes.status = 'FINISHED'"
    runs = client.search_runs([exp.experiment_id], where, max_results=500)  # (a killed job's run: left out)
    if not runs:
        raise CcexpError(f"no runs in experiment {experiment!r}" + (f" under sweep {parent}" if parent else "")
                         + "; run ccexp first")
    logged = set().union(*(r.data.metrics for r in runs))
    # the rounded headline copies and, in a sweep, their differences against the baseline (they sort in the order
    # they matter: MLflow orders metric columns by name); runs from before them: the eval/ headline metrics
    metrics = sorted(m for m in logged if is_headline_key(m)) or [m for m in HEADLINE if m in logged]
    # the question's column first; runs from before its rounded copy: macro ppl's, else the question's full name
    primary = next((m for m in (HEADLINE_KEYS["bpb"], HEADLINE_KEYS["ppl_macro"], PRIMARY) if m in logged), None)
    group = group_key(runs)
    params = [p for p in ("sampler.name", "seed") if any(p in r.data.params for r in runs) and not (group and p == "seed")]
    state = {
        "searchFilter": where, "orderByKey": f"metrics.`{primary}`" if primary else "attributes.start_time",
        "orderByAsc": primary is not None, "startTime": "ALL", "lifecycleFilter": "Active", "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": [f"metrics.`{m}`" for m in metrics] + [f"params.`{p}`" for p in params],
        "runsPinned": [], "runsHidden": [], "runsExpanded": {}, "runListHidden": False,
        "groupBy": {"aggregateFunction": "average", "groupByKeys": [group]} if group else None,
        # the chart view (compareRunsMode=CHART): one bar chart per headline column, a bar per sampler when grouped
        # (isAccordionReordered: the UI keeps this section first; else it sorts sections by name, "cache" first)
        "compareRunSections": [{"uuid": "ccexp-headline", "name": "ccexp: headline", "display": True,
                                "isReordered": False}], "isAccordionReordered": True,
        "compareRunCharts": [{"uuid": f"ccexp-{i}", "type": "BAR", "runsCountToCompare": 100,
                              "metricSectionId": "ccexp-headline", "deleted": False, "isGenerated": False,
                              "metricKey": m, "displayName": m} for i, m in enumerate(metrics)
                             if not m.endswith(" ci")],
    }
    key = f"ccexp-{(parent or 'all')[:12]}"
    _save_view(client, exp.experiment_id, SHARED_VIEW + key, state)
    return exp.experiment_id, key, metrics


def _save_view(client, experiment_id: str, tag: str, state: dict) -> None:
    """The view as the experiment tag MLflow's UI reads it from; a store this process cannot write is one line.

    Raises:
        CcexpError: for a read-only store.
    """
    import logging

    chatter = logging.getLogger("mlflow.store.db.utils")  # logs SQLite's error with its traceback before raising it
    level = chatter.level
    chatter.setLevel(logging.CRITICAL)
    try:
        client.set_experiment_tag(experiment_id, tag, json.dumps(state))
    except Exception as e:  # noqa: BLE001 (MLflow wraps SQLite's error in its own types)
        if "readonly" not in str(e).replace("-", "").replace(" ", "").lower():
            raise
        raise CcexpError(f"the MLflow store {client.tracking_uri} cannot be written here (read-only), and ccexp.ui "
                         "saves its view in it (an experiment tag); copy the store to a folder you may write and "
                         "pass that copy, or open it with mlflow ui") from None
    finally:
        chatter.setLevel(level)


def group_key(runs: list) -> dict | None:
    """How the view groups ``runs``: by their sweep's verdict
    ([`VERDICT_TAG`][ccexp.compare.verdict.VERDICT_TAG], so each group's row starts with it), else by sampler, else
    not at all (None)."""
    from ccexp.compare.verdict import VERDICT_TAG

    if any(VERDICT_TAG in r.data.tags for r in runs):
        return {"mode": "tag", "groupByData": VERDICT_TAG}
    return {"mode": "param", "groupByData": "sampler.name"} if any("sampler.name" in r.data.params for r in runs) else None


def grouped_by_verdict(client, experiment_id: str, key: str) -> bool:
    """True when the shared view ``key`` groups its runs by their sweep's verdict
    ([`VERDICT_TAG`][ccexp.compare.verdict.VERDICT_TAG])."""
    state = json.loads(client.get_experiment(experiment_id).tags.get(SHARED_VIEW + key, "{}"))
    return any(k.get("mode") == "tag" for k in ((state.get("groupBy") or {}).get("groupByKeys") or []))


def url_host(host: str) -> str:
    """``host`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def default_host() -> str:
    """Where ``python -m ccexp.ui`` serves: ``::1`` (IPv6 loopback) where this machine has it, else 127.0.0.1.
    MLflow 3.17 opens its Assistant panel over a third of the page on the first visit to a server it takes for
    local by name (``localhost``, ``127.0.0.1``; the panel needs an LLM provider set up to answer anything); at
    ``http://[::1]:<port>`` it stays closed and the comparison has the page's whole width. Either is this
    machine only."""
    import socket

    if socket.has_ipv6:
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
                s.bind(("::1", 0))
            return "::1"
        except OSError:
            pass
    return "127.0.0.1"


def run_address(host: str, port: int, experiment_id: str, run_id: str, base: str | None = None) -> str:
    """The UI address of run ``run_id``'s page in the model-training layout (a sweep's parent run: its verdict as
    the description, each sampler's figures as metrics, the chart ``by_sampler.png`` first among its artifacts)."""
    root = base.rstrip("/") if base else f"http://{url_host(host)}:{port}"
    return f"{root}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def view_address(host: str, port: int, experiment_id: str, key: str, base: str | None = None,
                 chart: bool = False) -> str:
    """The UI address of the shared view ``key`` (in the UI's model-training mode, not GenAI), on
    ``http://host:port`` or on the tracking server ``base``; ``chart``: its chart mode (a bar per group)."""
    root = base.rstrip("/") if base else f"http://{url_host(host)}:{port}"
    return (f"{root}/#/experiments/{experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning"
            + ("&compareRunsMode=CHART" if chart else ""))


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on, on any address ``host`` names (``localhost``: 127.0.0.1
    and ::1, where another server may hold it), as the server would bind it (SO_REUSEADDR, so a port left in
    TIME_WAIT by an earlier UI is free); and a host that is not an address of this machine.

    Raises:
        CcexpError: naming the port or the host and what to pass instead.
    """
    import errno
    import socket

    try:
        addresses = {(a[0], a[4][:2]) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        if host == "localhost" and socket.has_ipv6:  # browsers and curl try ::1 too, whatever /etc/hosts says
            addresses |= {(socket.AF_INET6, ("::1", port)), (socket.AF_INET, ("127.0.0.1", port))}
    except socket.gaierror as e:
        raise CcexpError(f"--host {host}: not a name or address this machine can resolve ({e.strerror}); "
                         "pass --host 127.0.0.1 (or 0.0.0.0 to serve other machines)") from None
    for family, address in sorted(addresses, key=str):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise CcexpError(f"port {port} on {address[0]} is in use ({e.strerror}): another server (an "
                                     "earlier ccexp.ui?) listens there; stop it, or pass --port with a free port"
                                     ) from None
                if e.errno == errno.EADDRNOTAVAIL and len(addresses) > 1:
                    continue  # e.g. ::1 on a machine without IPv6: the other address serves
                raise CcexpError(f"--host {host}: cannot listen on {address[0]}:{port} ({e.strerror}); pass --host "
                                 "127.0.0.1 (or 0.0.0.0 to serve other machines)") from None


def serve(uri: str, host: str, port: int, wait_s: float = 120.0) -> subprocess.Popen:
    """Start ``mlflow server`` on the tracking URI ``uri`` and wait until it answers ``/health``.

    The port must be free: another server answering ``/health`` there (a ccexp.ui left open on another
    store) would be taken for this one, so a port in use is refused first, and only an answer while the
    child still runs counts.

    Raises:
        CcexpError: for a port in use, or a server that exits or does not answer within ``wait_s`` seconds.
    """
    _check_port_free(host, port)
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host,
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = [ln for ln in (proc.stderr.read() or "").splitlines() if ln.strip()][-1:]
            raise CcexpError(f"mlflow server on {host}:{port} exited with status {proc.returncode}"
                             + (f": {tail[0].strip()}" if tail else "") + "; is the port in use? pass --port")
        try:
            with urllib.request.urlopen(f"http://{url_host(host)}:{port}/health", timeout=2) as r:
                if r.status == 200 and proc.poll() is None:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise CcexpError(f"mlflow server on {host}:{port} did not answer within {wait_s:.0f} s")


def _latest_sweep(client, experiment: str) -> str | None:
    from ccexp.compare.report import latest_sweep

    try:
        return latest_sweep(client, experiment)
    except CcexpError:
        return None


def _port(text: str) -> int:
    """argparse's type for ``--port``: an integer in 1..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port; use 1-65535")
    return port


def print_addresses(args: argparse.Namespace, store, experiment_id: str, key: str, metrics: list[str]) -> None:
    """The addresses ``python -m ccexp.ui`` prints: the view in chart mode where its runs are grouped by a sweep's
    verdict (each legend entry names one), the view as a table, and the sweep's parent run."""
    from ccexp.tracking.store import read_store

    client = read_store(store.uri)
    parent = args.parent or _latest_sweep(client, args.experiment)
    whose = "the sweep's runs" if parent else f"the runs of experiment {args.experiment!r}"
    base = store.uri if store.is_server else None
    if grouped_by_verdict(client, experiment_id, key):
        print(f"ccexp.ui: {whose}, a bar per sampler; each chart's legend names its sampler's verdict:", flush=True)
        print(view_address(args.host, args.port, experiment_id, key, base, chart=True), flush=True)
    print(f"ccexp.ui: {whose} by sampler, columns {', '.join(metrics) or '(no held-out metric yet)'}:",
          flush=True)
    print(view_address(args.host, args.port, experiment_id, key, base), flush=True)
    if parent is not None:
        print("ccexp.ui: the sweep's own run (its verdict, each sampler's figures, the chart by_sampler.png):",
              flush=True)
        print(run_address(args.host, args.port, experiment_id, parent, base), flush=True)


def main(argv: list[str] | None = None) -> None:
    from ccexp.compare.report import outputs_argument
    from ccexp.help import plain

    argv = outputs_argument(argv)
    ap = argparse.ArgumentParser(prog="python -m ccexp.ui", description=plain(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=None,
                    help="SQLite MLflow store, or the outputs folder that holds it (paths.outputs=<dir> also works; "
                         "default: MLFLOW_TRACKING_URI when set, else outputs/mlflow.db)")
    ap.add_argument("--tracking-uri", default=None,
                    help="any MLflow tracking URI (overrides --store); a server's: the view is opened in its own UI")
    ap.add_argument("--experiment", default="ccexp", help="the MLflow experiment (default ccexp)")
    ap.add_argument("--parent", default=None, help="a sweep's parent run id (default: the latest sweep)")
    ap.add_argument("--host", default=None, help="the address to serve on (default ::1 where this machine has IPv6 "
                                                   "loopback, else 127.0.0.1; 0.0.0.0 serves other machines)")
    ap.add_argument("--port", type=_port, default=5000, help="a TCP port, 1-65535 (default 5000)")
    ap.add_argument("--no-server", action="store_true", help="only write the view and print its address")
    args = ap.parse_args(argv)
    args.host = args.host or default_host()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped ccexp.ui stops its server too (finally)
    proc = None
    try:
        from ccexp.compare.report import cli_store
        from ccexp.tracking.store import check_server, read_store

        store = cli_store(args.store, args.tracking_uri)
        check_server(store)
        print(store.line("ccexp.ui"), file=sys.stderr, flush=True)
        if not args.no_server and not store.is_server:
            _check_port_free(args.host, args.port)  # --host and --port before the view is written
        experiment_id, key, metrics = compare_view(read_store(store.uri), args.experiment, args.parent)
        if not args.no_server and not store.is_server:
            proc = serve(store.uri, args.host, args.port)
        print_addresses(args, store, experiment_id, key, metrics)
        if store.is_server:
            print(f"ccexp.ui: the view is in the tracking server's own UI ({store.uri}); nothing to start", flush=True)
        if proc is not None:
            print("ccexp.ui: MLflow UI running; Ctrl-C stops it", flush=True)
            proc.wait()
    except CcexpError as e:
        print(f"ccexp.ui: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    from ccexp.runtime import run_command

    run_command(main)
