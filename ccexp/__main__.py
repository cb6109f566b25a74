"""``python -m ccexp [overrides]``: the Hydra entry point (thin; the run is [`ccexp.pipeline.run`][ccexp.pipeline.run]).

User errors (bad config, bad input, missing files) print one line, ``ccexp: error: ...``, and exit 2.
A signal (SIGTERM from Slurm or Kubernetes, SIGINT from Ctrl-C) stops the run with one line and
status 128 + signal (143, 130) after saving a checkpoint to resume from; in a job of
``hydra/launcher=slurm`` the same holds, and SIGUSR2 (the job's time limit is near) stops it too
and has submitit requeue it ([`ccexp.launch.launcher`][ccexp.launch.launcher]). In a sweep (``-m``) a job that fails
records its line in its folder and the sweep goes on; the sweep then exits 1 with the list of
failed jobs.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ccexp.conf import CONFIG_DIR  # noqa: F401  (re-exported: the shipped config folder)
from ccexp.config import register
from ccexp.errors import CcexpError, one_line

log = logging.getLogger("ccexp")
register()


@hydra.main(version_base="1.3", config_path="pkg://ccexp.conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from hydra.types import RunMode

    from ccexp.errors import Interrupted, StoppedEarly
    from ccexp.launch.launcher import catch_signals, end_job, in_launcher_job
    from ccexp.launch.resume import release_claims
    from ccexp.launch.sweep import write_job_status

    job_dir = Path(HydraConfig.get().runtime.output_dir)
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    overrides = list(HydraConfig.get().overrides.task)
    if in_launcher_job():  # a submitit job (hydra/launcher=slurm|local): no cli() around this call
        catch_signals()
    if multirun and kept_or_skipped(cfg, job_dir, overrides):
        return float("nan")
    try:
        from ccexp.preflight import check_inputs

        check_inputs(cfg)  # a wrong path or key is known before torch and Lightning are imported
        if cfg.recipe_note:
            log.warning("recipe %s: %s", cfg.recipe_name, cfg.recipe_note)
        from ccexp.pipeline import run

        metrics = run(cfg, job_dir, multirun=multirun)
    except Interrupted as e:
        if multirun:
            write_job_status(job_dir, "KILLED", str(e), overrides)
        if in_launcher_job():
            end_job(e)  # its line; SIGUSR2 to submitit, which requeues the job; exit 128 + signal, no result file
        raise
    except StoppedEarly as e:  # this job's own callback stopped it: incomplete, and the next job still runs
        if not multirun:
            raise
        log.warning("ccexp: %s", e)
        write_job_status(job_dir, "KILLED", str(e), overrides)
        return float("nan")
    except Exception as e:
        message = user_message(e, cfg.paths.outputs, written_folders(cfg))
        if not multirun:
            if message is None:
                raise  # a bug: keep the traceback
            to_log_file(f"ccexp: error: {message}")  # the run folder's ccexp.log says why it stopped
            fail(message)
        # in a sweep the next job still runs: the line goes to this job's log and status file
        log.error("ccexp: error: %s", message or f"{type(e).__name__}: {e}", exc_info=message is None)
        write_job_status(job_dir, "FAILED", message or f"{type(e).__name__}: {e} (traceback in {job_dir}/ccexp.log)",
                         overrides)
        return float("nan")
    finally:
        release_claims()  # this configuration's running claim (ccexp.launch.resume.claim): the run is over
    if multirun:
        write_job_status(job_dir, "FINISHED", "", overrides)
    # the objective a Hydra sweeper minimises: the comparison's question (report.primary; lower is better for it)
    question = str(cfg.report.primary)
    return float(metrics.get(question[len("eval/"):] if question.startswith("eval/") else question, float("nan")))


def kept_or_skipped(cfg: DictConfig, job_dir: Path, overrides: list[str]) -> bool:
    """True when this sweep job does not train: it finished in an earlier launch into the same sweep
    folder (kept), or it would train on the identical token stream as an earlier job of the sweep
    (skipped, unless ``report.skip_duplicates=false``); says which in one line."""
    from ccexp.launch.arms import duplicate_of
    from ccexp.launch.sweep import finished_before, write_job_status

    if finished_before(job_dir, overrides):
        log.info("sweep: job %s finished in an earlier launch of this sweep: kept, not retrained", job_dir.name)
        return True
    duplicate = duplicate_of(job_dir, overrides)
    if duplicate is None or not cfg.report.skip_duplicates:
        return False
    message = (f"identical token stream as job #{duplicate['same_as_job']} ({duplicate['same_as_label']}): "
               "skipped before training; report.skip_duplicates=false keeps it")
    log.info("sweep: job %s (%s): %s", job_dir.name, duplicate["label"], message)
    write_job_status(job_dir, "SKIPPED", message, overrides)
    return True


def written_folders(cfg) -> dict[str, str]:
    """The folders a run writes to, by the setting that names them (``paths.outputs``, ``paths.cache``, each extra
    logger's folder options: [`ccexp.tracking.loggers.folder_options`][ccexp.tracking.loggers.folder_options]): where
    a full disk can be, for its one line."""
    from ccexp.tracking.loggers import folder_options

    folders = {"paths.outputs": cfg.paths.outputs, "paths.cache": cfg.paths.get("cache")}
    for key, logger in (cfg.logger.get("loggers") or {}).items():
        folders.update({f"logger.loggers.{key}.{k}": v for k, v in folder_options(logger or {}).items()})
    return {k: str(v) for k, v in folders.items() if v}


def user_message(exc: BaseException, outputs: str | None = None, folders: dict[str, str] | None = None) -> str | None:
    """The one line for an error a user can fix (a full disk under ``outputs`` or another of ``folders``, the
    [`written_folders`][ccexp.__main__.written_folders], among them), or None for a bug."""
    from omegaconf.errors import MissingMandatoryValue

    from ccexp.errors import disk_full_line

    if isinstance(exc, MissingMandatoryValue):
        return f"{exc.full_key} is required and has no value; set it on the command line, e.g. {exc.full_key}=..."
    if isinstance(exc, CcexpError):
        return with_retired_hint(str(exc))
    return disk_full_line(exc, outputs, folders)


# settings that no longer exist, and what replaced them (appended to the error that names them)
RETIRED = {
    "global_batch_size": "a step is now tokens, not documents: set train.tokens_per_step (all ranks together) and "
                         "train.micro_batch_size (rows per forward pass)",
    "accumulate_grad_batches": "gradient accumulation is derived: tokens_per_step / (seq_len x micro_batch_size x "
                               "world size); set train.tokens_per_step or train.micro_batch_size",
}


def with_retired_hint(message: str) -> str:
    for key, hint in RETIRED.items():
        if f"'{key}'" in message or f".{key}" in message:
            message = f"{message}; {key} was retired: {hint}"
    return message


def to_log_file(message: str) -> None:
    """Write ``message`` (level ERROR) to the run's ``ccexp.log`` only (the console gets the one line)."""
    record = logging.LogRecord("ccexp", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def fail(message: str, code: int = 2) -> None:
    """Print one error line and exit with ``code`` (SystemExit passes through Hydra's job runner,
    which would otherwise add its own "Error executing job" line)."""
    print(f"ccexp: error: {with_retired_hint(message)}", file=sys.stderr)
    sys.exit(code)


def null_group_line(argv: list[str]) -> str | None:
    """The one line for a config group set to null (``trainer=null``), which Hydra refuses with a bare ValueError."""
    from ccexp.help import groups

    options = groups()
    for a in argv:
        key, _, value = a.lstrip("+~").partition("=")
        if value in ("null", "None", "~") and key in options:
            return f"{a}: a group needs one of its options ({', '.join(options[key])}); drop {a} to keep the default"
    return None


def null_parent_line(argv: list[str]) -> str | None:
    """The one line for an override that sets a key below a setting that is null with the chosen options
    (``eval=default eval.lm_eval.tasks=[]``: ``eval.lm_eval`` is null there), which OmegaConf refuses with a bare
    AssertionError while Hydra composes; None when no override is such."""
    from omegaconf import OmegaConf

    from ccexp.config import compose

    overrides = [a for a in argv if not a.startswith("-") and "=" in a]
    choices = [o for o in overrides if "." not in o.split("=", 1)[0]]  # group options and +recipe: the config's shape
    try:
        base = compose(choices)
    except Exception:  # noqa: BLE001 (the choices themselves are wrong: the caller keeps the original error)
        return None
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        parts = key.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if OmegaConf.select(base, parent, default="missing") is None:
                return (f"{o}: {parent} is null with these options, so {key} cannot be set; choose an option that sets "
                        f"{parent} (e.g. {parts[0]}=...) or drop the override")
    return None


def with_typo_hint(message: str, argv: list[str]) -> str:
    """Hydra's "Could not override 'a.b'" line for a misspelt key, with the setting it most likely meant
    (``did you mean 'sampler.clip_threshold'?``) instead of its advice to add the key with ``+``."""
    import difflib
    import re

    found = re.match(r"Could not override '([\w.]+)'\. To append to your config use \+\S+ ", message)
    if not found:
        return message
    key = found.group(1)
    try:
        from hydra.core.global_hydra import GlobalHydra

        from ccexp.config import compose

        GlobalHydra.instance().clear()
        node = compose([a for a in help_overrides(argv) if a.split("=", 1)[0].lstrip("+~") != key])
    except Exception:  # the hint is a courtesy: without it the line is still Hydra's, less its "+" advice
        return message.replace(found.group(0), f"Could not override '{key}': not a setting of this configuration ")
    meant = []
    for part in key.split("."):  # each part as written, or the setting at that level it most likely means
        keys = list(node.keys()) if OmegaConf.is_dict(node) else []
        close = [part] if part in keys else difflib.get_close_matches(part, keys, n=1, cutoff=0.6)
        if not close:  # ccexp's settings are closed (pre-flight refuses added keys): never advise "+"
            return message.replace(found.group(0), f"Could not override '{key}': not a setting of this configuration "
                                   "(python -m ccexp [group=option ...] --help lists them) ")
        meant.append(close[0])
        node = node._get_node(close[0]) if OmegaConf.is_dict(node) else None  # a ??? value is not read
    return message.replace(found.group(0), f"Could not override '{key}': did you mean '{'.'.join(meant)}'? ")


def help_overrides(argv: list[str]) -> list[str]:
    """The overrides of a ``--help`` call: flags dropped, each sweep (a comma list, ``range(...)``) at its
    first value, as Hydra's override grammar reads them ([`ccexp.plan.expand_sweep`][ccexp.plan.expand_sweep]).

    Raises:
        hydra.errors.HydraException: for an override the grammar cannot read.
    """
    from ccexp.plan import expand_sweep

    return expand_sweep([a for a in argv if not a.startswith("-")])[0]


def cli() -> None:
    import signal

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ccexp.errors import Interrupted, Refused, StoppedEarly, raise_interrupted
    from ccexp.launch.sweep import LAST_SWEEP_FAILURES, SWEEP_STOPPED, close_active_sweep

    os.environ["HYDRA_FULL_ERROR"] = "1"  # let exceptions reach us; we print user errors as one line
    signal.signal(signal.SIGTERM, raise_interrupted)  # training replaces it to stop at a step boundary
    signal.signal(signal.SIGINT, raise_interrupted)  # not KeyboardInterrupt, on which Lightning exits with status 1
    try:
        if {"--help", "-h"} & set(sys.argv[1:]):  # every setting with its description, from the schemas
            from ccexp.help import help_text

            shown = help_overrides(sys.argv[1:])
            print(help_text(shown, swept=shown != [a for a in sys.argv[1:] if not a.startswith("-")]))
            return
        from ccexp.config import one_item_lists

        sys.argv[1:] = one_item_lists(sys.argv[1:])  # data.label_fields=domain: a one-item list
        main()
    except (Interrupted, KeyboardInterrupt) as e:
        stop = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        swept = close_active_sweep("KILLED", stop=str(stop))  # a sweep: what each job left, and how to continue
        print(f"ccexp: {stop}" + ("" if "checkpoint" in str(stop) else "; finished stages stay cached, unfinished ones "
                                  "were discarded") + (f"; {swept[-1].removeprefix('sweep: ')}" if swept else ""),
              file=sys.stderr)
        sys.exit(stop.exit_code)
    except StoppedEarly as e:
        print(f"ccexp: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (CcexpError, Refused) as e:
        close_active_sweep("FAILED")
        fail(str(e))
    except (HydraException, OmegaConfBaseException) as e:
        close_active_sweep("FAILED")
        cause = e.__cause__ or e.__context__
        fail(str(cause) if isinstance(cause, CcexpError) else with_typo_hint(one_line(e), sys.argv[1:]))
    except Exception as e:
        close_active_sweep("FAILED")  # a crash of the sweep itself (e.g. its launcher): never leave it RUNNING
        from ccexp.errors import disk_full_line

        line = disk_full_line(e) or (null_parent_line(sys.argv[1:]) if isinstance(e, AssertionError) else None) or \
            (null_group_line(sys.argv[1:]) if isinstance(e, ValueError) and "Config group override" in str(e) else None)
        if line is None:
            raise
        fail(line)
    if SWEEP_STOPPED:  # the jobs of hydra/launcher=packed stopped at a step's end; the sweep's summary said what is left
        stop = SWEEP_STOPPED[0]
        print(f"ccexp: sweep {stop}; the same command continues it (finished jobs kept, stopped ones from their "
              "checkpoints)", file=sys.stderr)
        sys.exit(stop.exit_code)
    if LAST_SWEEP_FAILURES:
        fail(f"{len(LAST_SWEEP_FAILURES)} sweep job(s) failed: " + " | ".join(LAST_SWEEP_FAILURES), code=1)


if __name__ == "__main__":
    from ccexp.runtime import run_command

    run_command(cli)
