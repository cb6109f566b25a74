"""Process-wide settings of a run: offline flags and one line per library message."""
from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    """Offline flags, and one line per message through Hydra's handlers (no duplicate or tip lines)."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # it logs each CPU variant it tries
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "Tip:" not in r.getMessage())
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")  # Lightning's own use of a torch deprecation
    # on any machine with Slurm installed (a login node, a workstation): ccexp's Slurm launcher starts the
    # ranks with srun, and a run outside Slurm is not a mistake
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    import sys

    if not sys.stderr.isatty():  # redirected to a file: libraries' tqdm bars would be one \r-joined line
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' weight loading, lm-eval's requests, datasets
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
