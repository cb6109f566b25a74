"""Shared fixtures: hermetic HF caches, offline flags, a small real corpus from the embedded default."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from warm import python_m

ROOT = Path(__file__).resolve().parents[1]


COLLECTED = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Count the tests before ``-m`` deselects any: ``{"fast": n, "slow": n, "files": [test file names]}`` in
    ``config.stash[COLLECTED]`` (tests/test_docs_figures.py checks the counts docs/testing.md states)."""
    slow = sum(1 for item in items if item.get_closest_marker("slow") is not None)
    config.stash[COLLECTED] = {"fast": len(items) - slow, "slow": slow,
                               "files": sorted({item.path.name for item in items})}


@pytest.fixture(autouse=True, scope="session")
def _offline(tmp_path_factory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield


@pytest.fixture(autouse=True)
def _environment_kept_to_its_test():
    """Each test gets ``os.environ`` as the session set it, and leaves it so. What a test's own process sets stays
    with that test: MLflow's ``set_tracking_uri`` (called by Lightning's MLFlowLogger and MLflow's fluent API when a
    run opens in the test's process) writes ``MLFLOW_TRACKING_URI``, a pipeline run in process sets
    ``HYDRA_FULL_ERROR``, ``TQDM_DISABLE``, ``OMP_NUM_THREADS`` or Lightning's ``PL_GLOBAL_SEED``; every later
    ``python -m ccexp`` would inherit them (and log to that test's store), and a command whose environment differs
    from the warm processes' runs fresh (tests/warm.py)."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


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


def run_ccexp(*args: str, cwd: Path, timeout: int = 600, env: dict[str, str | None] | None = None) \
        -> subprocess.CompletedProcess:
    """Run ``python -m ccexp`` as a user would, in ``cwd``; ``env`` sets variables (None removes one). A process of
    its own, started warm where the environment allows (tests/warm.py)."""
    env = {k: v for k, v in {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}.items() if v is not None}
    return python_m("ccexp", *args, cwd=cwd, env=env, timeout=timeout)


NO_SLURM = "no Slurm cluster: start one with scripts/slurm_local.sh start, then export SLURM_CONF=/tmp/ccexp-slurm/slurm.conf"


@pytest.fixture(scope="session")
def slurm_cluster() -> dict:
    """The running Slurm cluster ``SLURM_CONF`` names (``scripts/slurm_local.sh start`` makes one): its
    default partition and CPUs per node, as sinfo answers; without one the test is skipped, with one
    reason line for all of them (:data:`NO_SLURM`); with ``CCEXP_REQUIRE_SLURM=1`` (CI) they fail instead."""
    import shutil

    missing = pytest.fail if os.environ.get("CCEXP_REQUIRE_SLURM") == "1" else pytest.skip
    if not os.environ.get("SLURM_CONF") or shutil.which("sinfo") is None:
        missing(NO_SLURM)
    try:
        proc = subprocess.run(["sinfo", "--noheader", "--format=%P %a %c"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        missing(NO_SLURM)
    rows = [line.split() for line in proc.stdout.splitlines() if len(line.split()) == 3]
    up = [r for r in rows if r[1] == "up"]
    if proc.returncode != 0 or not up:
        missing(NO_SLURM)
    partition, _, cpus = next((r for r in up if r[0].endswith("*")), up[0])
    return {"partition": partition.rstrip("*"), "cpus": int(cpus.rstrip("+"))}
