"""``hydra/launcher=packed``: several runs at once on this machine, each with its share of it. On GPUs,
``runs_per_device`` runs share each visible device (a tiny model is launch-bound: one run leaves most of a
GPU idle), job n on GPU n mod GPUs; without a GPU, ``runs_per_device`` runs at once. Either way the cores are
split evenly between the runs at once (``trainer.threads``), so they do not fight over them. The launcher
itself is ``hydra_plugins/ccexp_launcher``'s ``PackedLauncher`` (hydra-joblib-launcher's worker processes).
"""
from __future__ import annotations

import logging
import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger("ccexp")


class Packing:
    """How ``hydra/launcher=packed`` shares this machine: ``runs_per_device`` jobs at once on each of ``gpus``
    visible GPUs (processes sharing a device), or ``runs_per_device`` jobs at once on a machine without one;
    the ``cores`` are split evenly between all the jobs at once (``threads`` each, at least 1).

    Raises:
        CcexpError: for ``runs_per_device`` that is not a whole number >= 1.
    """

    def __init__(self, runs_per_device: int, gpus: int, cores: int) -> None:
        from ccexp.errors import CcexpError

        if isinstance(runs_per_device, bool) or not isinstance(runs_per_device, int) or runs_per_device < 1:
            raise CcexpError(f"hydra.launcher.runs_per_device={runs_per_device!r}: give a whole number >= 1 of runs "
                             "at once per device")
        self.runs_per_device, self.gpus = int(runs_per_device), max(0, int(gpus))
        self.jobs = self.runs_per_device * max(1, self.gpus)  # at once
        self.threads = max(1, int(cores) // self.jobs)

    def share(self, job_num: int) -> dict[str, Any]:
        """The settings job ``job_num`` runs with: ``trainer.threads``, and on GPUs ``trainer.devices`` = [its
        GPU], the jobs taken round-robin (job n on GPU n mod gpus)."""
        out: dict[str, Any] = {"threads": self.threads}
        if self.gpus:
            out["devices"] = [int(job_num) % self.gpus]
        return out

    def describe(self) -> str:
        where = f"each of {self.gpus} GPU(s) ({self.jobs} at once in all)" if self.gpus else "this machine (no GPU)"
        return f"packed: up to {self.runs_per_device} job(s) at once on {where}, trainer.threads={self.threads} each"


class StoppingTask:
    """A sweep's task function run in a launcher's worker process (joblib's), stopped as a single run is
    ([`SweepStop`][ccexp.launch.packing.SweepStop]): SIGTERM or SIGINT while the job trains ends it at the step's end
    with its checkpoint, run.json ``stopped``, its MLflow run and ``status.json`` KILLED; a job whose turn comes after
    the sweep was stopped does not start (``status.json`` KILLED, "not started"). Either way the job returns to the
    sweep, which waits for every job and then says what is left to continue. A plain object, so the launcher's worker
    processes can unpickle it."""

    def __init__(self, task_function: Any) -> None:
        self.task_function = task_function

    def prepare(self, cfg: Any, job_num: int) -> None:
        """What a job's config gets before it runs (nothing here)."""

    def __call__(self, cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        from ccexp.errors import Interrupted
        from ccexp.launch.launcher import catch_signals

        hydra = HydraConfig.get()
        stop, job_dir = SweepStop(Path(str(hydra.sweep.dir))), Path(str(hydra.runtime.output_dir))
        overrides = list(hydra.overrides.task)
        try:
            catch_signals()  # SIGTERM (the sweep's, passed on) and SIGINT (a terminal's Ctrl-C) stop the job
            stop.enter()
            if stop.requested():
                return _not_started(job_dir, overrides, stop.requested())
            self.prepare(cfg, hydra.job.num)
            return self.task_function(cfg)
        except Interrupted as e:  # the entry point wrote its KILLED status when the job had started
            return _not_started(job_dir, overrides, str(e)) if not (job_dir / "status.json").is_file() else float("nan")
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):  # between jobs a worker waits; a late signal changes nothing
                signal.signal(signum, signal.SIG_IGN)
            stop.leave()


class PackedTask(StoppingTask):
    """The sweep's task function with each job's share of the machine ([`Packing.share`][ccexp.launch.packing.Packing.share]) written
    into its config before it runs (so its run records the threads and device it used), stopped as
    [`StoppingTask`][ccexp.launch.packing.StoppingTask] says."""

    def __init__(self, task_function: Any, packing: Packing) -> None:
        super().__init__(task_function)
        self.packing = packing

    def prepare(self, cfg: Any, job_num: int) -> None:
        from omegaconf import open_dict

        share = self.packing.share(job_num)
        with open_dict(cfg):
            cfg.trainer.threads = share["threads"]
            if "devices" in share and str(cfg.trainer.accelerator) in ("gpu", "cuda", "auto"):
                cfg.trainer.devices = share["devices"]


def _not_started(job_dir: Path, overrides: list[str], why: str) -> float:
    from ccexp.launch.status import write_job_status

    write_job_status(job_dir, "KILLED", f"not started: the sweep was {why}", overrides)
    return float("nan")


class SweepStop:
    """A packed sweep's stop, shared by its launching process and its worker processes through the sweep folder:
    ``<sweep_dir>/.stopping`` (the signal's line, once one came) and ``<sweep_dir>/.workers/<pid>`` (each worker
    process while it runs a job).

    The launching process [`listens`][ccexp.launch.packing.SweepStop.listening] while the jobs run: on SIGINT or SIGTERM it
    writes ``.stopping``, passes SIGTERM on to each worker in a job (a job stops at its step's end and saves its
    checkpoint, as a single run on Ctrl-C), and keeps waiting for them; jobs not yet started see ``.stopping`` and do
    not start. It then records the stop in ``ccexp.launch.status.SWEEP_STOPPED`` for the sweep's end to sum up."""

    def __init__(self, sweep_dir: Path) -> None:
        self.flag, self.workers = Path(sweep_dir) / ".stopping", Path(sweep_dir) / ".workers"
        self.stop = None  # the Interrupted of the signal that came (launching process)

    def requested(self) -> str | None:
        """The stop's line ("stopped by SIGINT") once the sweep was stopped, else None."""
        try:
            return self.flag.read_text() or "stopped"
        except OSError:
            return None

    def enter(self) -> None:
        self.workers.mkdir(parents=True, exist_ok=True)
        (self.workers / str(os.getpid())).touch()

    def leave(self) -> None:
        (self.workers / str(os.getpid())).unlink(missing_ok=True)

    def _on_signal(self, signum: int, frame: Any) -> None:
        from ccexp.errors import Interrupted

        if self.stop is not None:
            log.warning("sweep: %s again: still waiting for the jobs to save their checkpoints",
                        signal.Signals(signum).name)
            return
        self.stop = Interrupted(signum)
        self.flag.parent.mkdir(parents=True, exist_ok=True)
        self.flag.write_text(str(self.stop))
        log.warning("sweep: %s received: each job that trains stops after its step and saves a checkpoint; the jobs "
                    "not started yet will not start", self.stop.name)
        for worker in self.workers.glob("*"):
            try:
                os.kill(int(worker.name), signal.SIGTERM)
            except (ValueError, ProcessLookupError, PermissionError):
                pass

    @contextmanager
    def listening(self):
        """While the jobs run (the launching process): SIGINT and SIGTERM stop the sweep as the class says; the
        previous handlers come back after, and the stop is recorded for the sweep's end."""
        from ccexp.launch.status import SWEEP_STOPPED

        self.flag.unlink(missing_ok=True)  # a stop of an earlier launch into this folder is not this one's
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in previous:
            signal.signal(signum, self._on_signal)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.flag.unlink(missing_ok=True)
            if self.stop is not None:
                SWEEP_STOPPED[:] = [self.stop]
