"""``python -m ccexp.deliver <store>``: deliver to its tracking server what a run logged while the server was
away (the local store the run's last line names, ``<run folder>/mlflow-local``).

Every run of that store not yet delivered goes into the server run it stands for (or a new run there, when
it was begun while the server was away, or the server no longer has it): every metric value with its
step and timestamp, the params, the tags, the artifact files and the run's end. Delivering twice is
harmless. See [`ccexp.tracking.server`][ccexp.tracking.server].

Usage:
    python -m ccexp.deliver outputs/runs/<date>/<time>-<pid>/mlflow-local
    python -m ccexp.deliver <store> --tracking-uri http://mlflow.example:5000   # another server than recorded
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ccexp.errors import CcexpError


def main(argv: list[str] | None = None) -> None:
    from ccexp.help import plain

    ap = argparse.ArgumentParser(prog="python -m ccexp.deliver", description=plain(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", help="the local store's folder (the run's line names it), or the run folder holding it")
    ap.add_argument("--tracking-uri", default=None, help="the server to deliver to (default: the one each run records)")
    args = ap.parse_args(argv)
    import os

    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # the line below names the run
    from ccexp.tracking.server import LOCAL_STORE, deliver_store

    if not args.store.strip():
        ap.error("the store is an empty string; give the local store's folder (<run folder>/mlflow-local)")
    folder = Path(args.store).expanduser()
    if folder.is_file() and folder.name == "mlflow.db":
        folder = folder.parent  # the store's file was given: its folder
    if not (folder / "mlflow.db").is_file() and (folder / LOCAL_STORE / "mlflow.db").is_file():
        folder = folder / LOCAL_STORE  # the run folder was given
    try:
        done = deliver_store(folder, args.tracking_uri)
    except CcexpError as e:
        print(f"ccexp.deliver: error: {e}", file=sys.stderr)
        sys.exit(2)
    if not done:
        print(f"deliver: nothing to deliver in {folder}: every run in it was delivered")
    for name, server_id, counts, uri in done:
        print(f"deliver: run {name} -> {server_id} on {uri}: {counts['metrics']} metric values, {counts['params']} "
              f"params, {counts['tags']} tags, {counts['artifacts']} artifact files")


if __name__ == "__main__":
    from ccexp.runtime import run_command

    run_command(main)
