"""Screenshots of the MLflow UI for a sweep, in headless Chromium: the experiment's runs table and the
compare page of the sweep's runs (what a user sees when they open ``mlflow ui`` after a sweep).

Usage:
    python scripts/mlflow_screenshots.py --store outputs/mlflow.db --out docs/ui
Needs Debian's ``chromium`` (``apt-get install chromium``); starts ``mlflow server`` on a free local port.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
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
    ap.add_argument("--out", type=Path, default=Path("docs/ui"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow = Path(sys.executable).parent / "mlflow"
    server = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", f"sqlite:///{args.store.resolve()}",
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)

        def post(path: str, body: dict) -> dict:
            req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.load(r)

        exp = post("experiments/search", {"max_results": 10, "filter": f"name = '{args.experiment}'"})["experiments"][0]
        eid = exp["experiment_id"]
        parent = post("runs/search", {"experiment_ids": [eid], "filter": "tags.`ccexp.sweep` = 'true'",
                                      "order_by": ["attributes.start_time DESC"], "max_results": 1})["runs"][0]
        children = post("runs/search", {"experiment_ids": [eid], "filter":
                                        f"tags.mlflow.parentRunId = '{parent['info']['run_id']}'"})["runs"]
        ids = [r["info"]["run_id"] for r in children]
        # MLflow 3's UI opens in its GenAI mode unless asked for the model-training view
        shoot(f"{base}/#/experiments/{eid}/runs?workflowType=machine_learning", args.out / "runs_table.png")
        query = urllib.parse.urlencode({"runs": json.dumps(ids), "experiments": json.dumps([eid]),
                                        "workflowType": "machine_learning"})
        shoot(f"{base}/#/compare-runs?{query}", args.out / "compare.png", height=1400)
        print(f"screenshots: {args.out / 'runs_table.png'}, {args.out / 'compare.png'}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
