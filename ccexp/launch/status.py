"""A sweep job's end as the sweep reads it: ``<job folder>/status.json`` (FINISHED, SKIPPED, FAILED or KILLED with
its one line and overrides), written by the job's side (the entry point, the launchers' workers) and read by the
sweep's callback ([`ccexp.launch.sweep`][ccexp.launch.sweep]); and the stop of the last multirun of this process."""
from __future__ import annotations

import json
from pathlib import Path

from ccexp.artifacts import write_text_atomic

STATUS_FILE = "status.json"
SWEEP_STOPPED: list = []  # the Interrupted that stopped the last multirun's jobs (hydra/launcher=packed), if one did


def write_job_status(job_dir: Path, status: str, message: str = "", overrides: list[str] | None = None) -> None:
    """Record a job's end: ``status`` FINISHED, SKIPPED, FAILED or KILLED, with its one-line ``message``
    and the ``overrides`` that set the job (so a later launch into the same folder recognises it)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(job_dir / STATUS_FILE,
                      json.dumps({"status": status, "message": message, "overrides": list(overrides or [])}))
