"""``python -m ccexp [overrides]``: the Hydra entry point (thin; the run is :func:`ccexp.pipeline.run`).

User errors (bad config, bad input, missing files) print one line, ``ccexp: error: ...``, and exit 2.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ccexp.config import register
from ccexp.errors import CcexpError

CONFIG_DIR = Path(__file__).resolve().parent / "conf"  # shipped inside the package (pkg://ccexp.conf)
log = logging.getLogger("ccexp")
register()


@hydra.main(version_base="1.3", config_path="pkg://ccexp.conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from omegaconf.errors import MissingMandatoryValue

    from ccexp.pipeline import run

    try:
        metrics = run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except MissingMandatoryValue as e:
        fail(f"{e.full_key} is required and has no value; set it on the command line, e.g. {e.full_key}=...")
    except CcexpError as e:
        fail(str(e))
    return float(metrics.get("ppl_macro", float("nan")))


# settings that no longer exist, and what replaced them (appended to the error that names them)
RETIRED = {
    "global_batch_size": "a step is now tokens, not documents: set train.tokens_per_step (all ranks together) and "
                         "train.micro_batch_size (rows per forward pass)",
    "accumulate_grad_batches": "gradient accumulation is derived: tokens_per_step / (seq_len x micro_batch_size x "
                               "world size); set train.tokens_per_step or train.micro_batch_size",
}


def fail(message: str) -> None:
    """Print one error line and exit with status 2 (SystemExit passes through Hydra's job runner,
    which would otherwise add its own "Error executing job" line)."""
    for key, hint in RETIRED.items():
        if f"'{key}'" in message or f".{key}" in message:
            message = f"{message}; {key} was retired: {hint}"
    print(f"ccexp: error: {message}", file=sys.stderr)
    sys.exit(2)


def one_line(exc: BaseException) -> str:
    """Condense Hydra/OmegaConf error text into one line: drop the search-path dump and the
    full_key/object_type details, list available options comma-separated, and append the
    underlying cause (e.g. the type error behind "Error merging override")."""
    parts: list[str] = []
    options: list[str] = []
    for ln in (x.strip() for x in str(exc).splitlines()):
        if ln.startswith("Config search path"):
            break
        if not ln or ln.startswith(("Set the environment variable HYDRA_FULL_ERROR", "full_key:", "object_type=",
                                    "reference_type=", "Traceback")):
            continue
        if ln.startswith("Available options"):
            parts.append(ln)
        elif parts and parts[-1].startswith("Available options") and " " not in ln:
            options.append(ln)
        else:
            parts.append(ln)
    text = " ".join(p + (" " + ", ".join(options) if p.startswith("Available options") else "") for p in parts)
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        text += " (" + one_line(cause) + ")"
    return text


def cli() -> None:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ["HYDRA_FULL_ERROR"] = "1"  # let exceptions reach us; we print user errors as one line
    try:
        main()
    except CcexpError as e:
        fail(str(e))
    except KeyboardInterrupt:
        print("ccexp: interrupted; finished stages stay cached, unfinished ones were discarded", file=sys.stderr)
        sys.exit(130)
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ or e.__context__
        fail(str(cause) if isinstance(cause, CcexpError) else one_line(e))


if __name__ == "__main__":
    cli()
