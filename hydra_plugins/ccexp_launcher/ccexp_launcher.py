"""``hydra/launcher=slurm`` and ``hydra/launcher=local``: hydra-submitit-launcher's launchers whose sweep
waits for every job's end, however it ends ([`ccexp.launch.launcher.EveryJobEnds`][ccexp.launch.launcher.EveryJobEnds]);
``hydra/launcher=joblib``: hydra-joblib-launcher's worker processes, whose jobs stop as a single run does on Ctrl-C;
``hydra/launcher=packed``: the same, several runs at once on each GPU, or on a machine without one, with the cores
split between them; ``hydra/sweeper=basic``: Hydra's basic sweeper, checking that a sweep's jobs compose once per
configuration rather than once per seed."""
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper as _BasicSweeper
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher as _JoblibLauncher
from hydra_plugins.hydra_submitit_launcher import submitit_launcher

from ccexp.launch.launcher import EveryJobEnds


class SlurmLauncher(EveryJobEnds, submitit_launcher.SlurmLauncher):
    """Slurm jobs through submitit, followed with squeue (no accounting needed)."""


class LocalLauncher(EveryJobEnds, submitit_launcher.LocalLauncher):
    """submitit's processes on this machine."""


class JoblibLauncher(_JoblibLauncher):
    """``hydra/launcher=joblib``: hydra-joblib-launcher's worker processes, whose jobs stop as a single run does on
    Ctrl-C or SIGTERM ([`ccexp.launch.packing.SweepStop`][ccexp.launch.packing.SweepStop]): each job that trains
    stops at its step's end with its checkpoint, the jobs not started do not start, and the sweep still waits for
    every job."""

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from ccexp.launch.packing import StoppingTask

        if not isinstance(task_function, StoppingTask):
            task_function = StoppingTask(task_function)
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        from pathlib import Path

        from ccexp.launch.packing import SweepStop

        with SweepStop(Path(str(self.config.hydra.sweep.dir))).listening():
            return super().launch(job_overrides, initial_job_idx)


class PackedLauncher(JoblibLauncher):
    """``hydra/launcher=packed``: ``runs_per_device`` jobs at once on each visible GPU, or on this machine
    without one, each with its share of the cores ([`ccexp.launch.launcher.Packing`][ccexp.launch.packing.Packing]), in hydra-joblib-launcher's
    worker processes, stopped as [`JoblibLauncher`][hydra_plugins.ccexp_launcher.ccexp_launcher.JoblibLauncher]'s."""

    def __init__(self, runs_per_device: int = 2, **joblib: Any) -> None:
        super().__init__(**joblib)
        self.runs_per_device = runs_per_device

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        import logging
        import os

        from ccexp.errors import CcexpError, Refused
        from ccexp.launch.packing import Packing, PackedTask

        try:
            packing = Packing(self.runs_per_device, visible_gpus(), os.cpu_count() or 1)
        except CcexpError as e:
            raise Refused(str(e)) from None
        self.joblib["n_jobs"] = packing.jobs
        logging.getLogger("ccexp").info("%s", packing.describe())
        super().setup(hydra_context=hydra_context, task_function=PackedTask(task_function, packing), config=config)


def visible_gpus() -> int:
    """The CUDA devices this process sees (0 without torch's CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class BasicSweeper(_BasicSweeper):
    """``hydra/sweeper=basic`` (Hydra's default sweeper, ccexp's settings file names this class): Hydra's basic
    sweeper, whose check that every job of a batch composes before the first starts composes one job of those that
    differ only in ``seed=<int>`` ([`ccexp.launch.arms.seedless`][ccexp.launch.arms.seedless]): an integer seed
    composes wherever another does, and 1,000 seeds of two samplers were 1,000 compositions (about 0.13 s each
    on 2 cores) before the first job. Jobs with another or no seed are each composed, as Hydra does."""

    def validate_batch_is_legal(self, batch: Any) -> None:
        from ccexp.launch.arms import seedless

        seen: set = set()
        kept = []
        for overrides in batch:
            key = seedless(list(overrides))
            if key is None or key not in seen:
                kept.append(overrides)
            if key is not None:
                seen.add(key)
        super().validate_batch_is_legal(kept)
