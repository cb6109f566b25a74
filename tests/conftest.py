"""Shared fixtures: hermetic HF caches, offline flags, a small real corpus from the embedded default."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _offline(tmp_path_factory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield


@pytest.fixture(scope="session")
def builtin_records() -> list[dict]:
    from ccexp.data.corpus import BUILTIN_PATH

    with gzip.open(BUILTIN_PATH, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, builtin_records) -> Path:
    """300 real documents from every domain of the embedded corpus (still unbalanced), as .jsonl.gz."""
    by_domain: dict[str, list[dict]] = {}
    for r in builtin_records:
        by_domain.setdefault(r["domain"], []).append(r)
    picked = []
    for domain, recs in sorted(by_domain.items()):
        picked += recs[: max(8, len(recs) // 40)]
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in picked:
            f.write(json.dumps(r) + "\n")
    return path


def run_ccexp(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python -m ccexp`` as a user would, in ``cwd``."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "ccexp", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
