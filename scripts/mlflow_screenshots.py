"""A screenshot of the MLflow UI for a sweep, in headless Chromium: the view ``python -m ccexp.ui`` prints
(the sweep's runs grouped by sampler, the headline held-out metrics as columns), as a user opens it.

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

    from ccexp.ui import compare_view, serve, view_address

    args.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"sqlite:///{args.store.resolve()}"
    eid, key, _ = compare_view(MlflowClient(uri), args.experiment, args.parent)  # what python -m ccexp.ui writes
    server = serve(uri, "127.0.0.1", port)
    try:
        shoot(view_address("127.0.0.1", port, eid, key), args.out / "compare_view.png", width=1800, height=900)
        print(f"screenshot: {args.out / 'compare_view.png'}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
