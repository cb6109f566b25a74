"""``hydra/launcher=packed``: several runs at once on this machine, each with its share of it. On GPUs,
``runs_per_device`` runs share each visible device (a tiny model is launch-bound: one run leaves most of a
GPU idle), job n on GPU n mod GPUs; without a GPU, ``runs_per_device`` runs at once. Either way the cores are
split evenly between the runs at once (``trainer.threads``), so they do not fight over them. The launcher
itself is ``hydra_plugins/ccexp_launcher``'s ``PackedLauncher`` (hydra-joblib-launcher's worker processes).
"""
from __future__ import annotations

from typing import Any


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
        where = f"each of {self.gpus} GPU(s)" if self.gpus else "this machine (no GPU)"
        return (f"packed: {self.runs_per_device} run(s) at once on {where}, {self.jobs} in all, "
                f"trainer.threads={self.threads} each")


class PackedTask:
    """The sweep's task function with each job's share of the machine ([`Packing.share`][ccexp.launch.packing.Packing.share]) written
    into its config before it runs (so its run records the threads and device it used); a plain object, so the
    launcher's worker processes can unpickle it."""

    def __init__(self, task_function: Any, packing: Packing) -> None:
        self.task_function, self.packing = task_function, packing

    def __call__(self, cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import open_dict

        share = self.packing.share(HydraConfig.get().job.num)
        with open_dict(cfg):
            cfg.trainer.threads = share["threads"]
            if "devices" in share and str(cfg.trainer.accelerator) in ("gpu", "cuda", "auto"):
                cfg.trainer.devices = share["devices"]
        return self.task_function(cfg)
