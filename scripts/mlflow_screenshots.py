"""Screenshots of the MLflow UI for a sweep, in headless Chromium, as ``python -m ccexp.ui`` opens it:

- ``compare_view.png``: the view it prints (the sweep's runs grouped by sampler, the headline metrics first,
  rounded, with each sampler's difference against the baseline);
- ``compare_chart.png``: the same view in chart mode (a bar of each headline metric per run);
- ``sweep_parent.png``: the sweep's parent run (its verdict as the description, each sampler's figures);
- ``sweep_chart.png``: the parent run's first artifact, ``by_sampler.png`` (the metric by sampler with its CI).

Usage:
    python scripts/mlflow_screenshots.py --store outputs/mlflow.db --out docs/ui [--experiment NAME]
Needs Debian's ``chromium`` (``apt-get install chromium``); starts ``mlflow server`` on a free local port.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def shoot(url: str, out: Path, width: int = 1600, height: int = 1000, wait_ms: int = 25000) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("chromium is not installed: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--window-size={width},{height}",
                        f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=180)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, default=Path("outputs/mlflow.db"))
    ap.add_argument("--experiment", default="ccexp")
    ap.add_argument("--parent", default=None, help="a sweep's parent run id (default: the latest sweep)")
    ap.add_argument("--out", type=Path, default=Path("docs/ui"))
    args = ap.parse_args()
    from mlflow import MlflowClient

    from ccexp.compare.report import latest_sweep
    from ccexp.ui import compare_view, default_host, run_address, serve, url_host, view_address

    args.out.mkdir(parents=True, exist_ok=True)
    host = default_host()  # where python -m ccexp.ui serves (MLflow's Assistant panel stays closed there)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    uri = f"sqlite:///{args.store.resolve()}"
    client = MlflowClient(uri)
    eid, key, _ = compare_view(client, args.experiment, args.parent)  # what python -m ccexp.ui writes
    parent = args.parent or latest_sweep(client, args.experiment)
    server = serve(uri, host, port)
    try:
        view = view_address(host, port, eid, key)
        shots = [(view, "compare_view.png"), (view + "&compareRunsMode=CHART", "compare_chart.png")]
        if parent:
            shots.append((run_address(host, port, eid, parent), "sweep_parent.png"))
            shots.append((f"http://{url_host(host)}:{port}/#/experiments/{eid}/runs/{parent}/artifacts/by_sampler.png"
                          "?workflowType=machine_learning", "sweep_chart.png"))  # the run's Artifacts tab, opened
        for url, name in shots:
            shoot(url, args.out / name, width=1800, height=1000)
            print(f"screenshot: {args.out / name} ({url})")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
