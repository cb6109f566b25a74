"""What a new MLflow store costs, made by MLflow from nothing against copied from ccexp's schema template.

Every ``python -m ccexp`` on a new ``paths.outputs`` (and every end-to-end test) opens a SQLite store that does
not exist yet. MLflow then creates its first tables and runs every schema migration since (alembic), then makes
the ``Default`` experiment. :func:`ccexp.tracking.store.open_store` instead copies an empty store at the schema
head, made once per MLflow version (``ccexp.tracking.store._from_schema_template``), and MLflow only makes
``Default``. Both ways are timed in this one process, interleaved, each on a new file; MLflow and SQLAlchemy are
imported before either is timed. Writes ``docs/measured/store_template.json`` (``--out``). Usage::

    python benches/bench_store_template.py             # 10 stores each way
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _made_by_mlflow(db: Path) -> None:
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{db}").search_experiments(max_results=1)


def _made_by_ccexp(db: Path) -> None:
    from ccexp.tracking.store import open_store

    open_store(f"sqlite:///{db}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "measured" / "store_template.json")
    args = parser.parse_args()
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        _made_by_ccexp(Path(tmp) / "warm.db")  # imports, and the template made once (not timed)
        seconds: dict[str, list[float]] = {"mlflow": [], "template": []}
        for i in range(args.stores):
            for way, make in (("mlflow", _made_by_mlflow), ("template", _made_by_ccexp)):
                t0 = time.perf_counter()
                make(Path(tmp) / f"{way}-{i}.db")
                seconds[way].append(time.perf_counter() - t0)
    median = {way: statistics.median(s) for way, s in seconds.items()}
    result = {"measured": time.strftime("%Y-%m-%d"), "mlflow": mlflow.__version__, "stores": args.stores,
              "median_s": {k: round(v, 4) for k, v in median.items()},
              "max_s": {k: round(max(v), 4) for k, v in seconds.items()},
              "ratio_mlflow_over_template": round(median["mlflow"] / median["template"], 1)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
