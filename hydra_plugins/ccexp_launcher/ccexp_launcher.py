"""``hydra/launcher=slurm`` and ``hydra/launcher=local``: hydra-submitit-launcher's launchers whose sweep
waits for every job's end, however it ends ([`ccexp.tracking.launcher.EveryJobEnds`][ccexp.tracking.launcher.EveryJobEnds])."""
from hydra_plugins.hydra_submitit_launcher import submitit_launcher

from ccexp.tracking.launcher import EveryJobEnds


class SlurmLauncher(EveryJobEnds, submitit_launcher.SlurmLauncher):
    """Slurm jobs through submitit, followed with squeue (no accounting needed)."""


class LocalLauncher(EveryJobEnds, submitit_launcher.LocalLauncher):
    """submitit's processes on this machine."""
