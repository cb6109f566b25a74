"""A newcomer's first setup: ``./scripts/setup.sh`` in a fresh clone of this checkout's HEAD, with an empty pip
cache (cold: everything downloaded) and then again with that cache warm, timed; and the size of the ``.venv``
it makes. Writes ``docs/measured/setup.json`` (``--write``), the source of the setup figures the README states
(tests/test_docs_figures.py checks them).

Usage:
    python benches/bench_setup.py [--write]      # about 6 minutes on an idle 2-core CPU
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup(clone: Path, cache: Path) -> float:
    """Seconds of ``scripts/setup.sh`` in ``clone`` with pip's cache at ``cache`` (a fresh .venv each time)."""
    shutil.rmtree(clone / ".venv", ignore_errors=True)
    env = {**os.environ, "PIP_CACHE_DIR": str(cache)}
    env.pop("VIRTUAL_ENV", None)
    t0 = time.perf_counter()
    done = subprocess.run(["./scripts/setup.sh"], cwd=clone, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"bench_setup: scripts/setup.sh failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds


def size_gb(path: Path) -> float:
    """Bytes on disk under ``path`` (``du``), in GB (10^9)."""
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
               .stdout.split()[0]) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write docs/measured/setup.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        clone, cache = Path(tmp) / "ccexp", Path(tmp) / "pip-cache"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        cold = setup(clone, cache)
        venv = size_gb(clone / ".venv")
        warm = setup(clone, cache)
    print(f"setup: cold (empty pip cache) {cold:.0f} s, warm {warm:.0f} s; .venv {venv:.2f} GB")
    if args.write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        out = ROOT / "docs" / "measured" / "setup.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"bench": "benches/bench_setup.py", "commit": commit, "cpus": os.cpu_count(),
                                   "measured": time.strftime("%Y-%m-%d"), "cold_seconds": cold,
                                   "warm_seconds": warm, "venv_gb": venv}, indent=1) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
