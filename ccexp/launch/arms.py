"""A sweep's arms before any training: every job's overrides, and which jobs would train on the
identical token stream as an earlier one.

Two jobs are duplicates when their configs agree outside the sampler (the same corpus, clustering,
model, seeds, budget and evaluation) and the sampler's model-free stream plan
([`ccexp.plan.stream_plan`][ccexp.plan.stream_plan], the same [`TokenStream`][ccexp.data.packing.TokenStream] as training) has the
same digest: they would train the same model on the same tokens. ClusterClip whose clip never binds
at the budget is the common case: its stream is uniform's. A policy that follows the training loss
(``needs_feedback``: ODM, DoReMi) cannot be planned and is never called a duplicate.

[`find_duplicates`][ccexp.launch.arms.find_duplicates] is called by the sweep callback when the multirun starts
([`MlflowSweepCallback`][ccexp.launch.sweep.MlflowSweepCallback]); it writes ``duplicates.json`` into the sweep
folder, and a job listed there is skipped (``report.skip_duplicates``) by the entry point.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("ccexp")
DUPLICATES_FILE = "duplicates.json"


def job_overrides(config: DictConfig) -> list[list[str]] | None:
    """Every job's overrides, in launch order, as Hydra's basic sweeper expands them (the sweep config's
    ``hydra.sweeper.params`` first, then the command line; the first key varies slowest); None for
    another sweeper."""
    from ccexp.plan import expand_sweep

    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
    if not sweeper.endswith("BasicSweeper"):
        return None
    params = [f"{k}={v}" for k, v in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
    return expand_sweep(params + list(config.hydra.overrides.task))


def same_job(a: list[str], b: list[str]) -> bool:
    """True when two override lists set the same job: the same keys with the same values, however they
    were written (``x=false`` and ``x=False``) and in whatever order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def normal(overrides: list[str]) -> list[tuple[str, str]]:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        return sorted((o.get_key_element(), o.get_value_element_as_str()) for o in parsed)

    return normal(a) == normal(b)


def _setup_key(cfg: DictConfig) -> str:
    """Everything of a job's config that is not the sampler's policy (its level stays: it picks the clusters)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    sampler = container.pop("sampler", {})
    for key in ("report", "plan"):
        container.pop(key, None)
    container["sampler.level"] = sampler.get("level", 0)
    return json.dumps(container, sort_keys=True, default=str)


def find_duplicates(config: DictConfig, jobs: list[list[str]]) -> list[dict]:
    """The jobs whose token stream equals an earlier job's (see the module docstring): for each, its
    number, overrides, sampler and seed and the job it repeats. Stages the plans need are computed (or
    reused) here, before any training. A job that cannot run (a budget its sampler cannot supply, a bad
    setting) is named in a warning now, before any other job trains; after three such jobs the check
    stops (a problem the jobs share: each says it in its own line)."""
    from hydra import compose
    from hydra.errors import HydraException
    from hydra.utils import get_method
    from omegaconf.errors import OmegaConfBaseException

    from ccexp.config import component
    from ccexp.errors import CcexpError, one_line
    from ccexp.plan import stream_plan

    seen: dict[tuple[str, str], int] = {}
    names: dict[int, str] = {}
    common = set.intersection(*(set(j) for j in jobs)) if jobs else set()
    label = [" ".join(o for o in j if o not in common) or " ".join(j) for j in jobs]  # what sets each job apart
    out, failures = [], 0
    for num, overrides in enumerate(jobs):
        try:
            cfg = compose(config_name="config", overrides=overrides)
            if getattr(get_method(cfg.sampler._target_), "needs_feedback", False) or \
                    component("sampler", cfg.sampler).prior_run(cfg.sampler) is not None:
                continue  # a stream that depends on losses, or on a prior run's output: not planned without a model
            digest = stream_plan(cfg).digest
        except (CcexpError, HydraException, OmegaConfBaseException) as e:  # the job itself will say it in one line
            failures += 1
            log.warning("sweep: job #%d (%s) cannot run: %s", num, label[num],
                        e if isinstance(e, CcexpError) else one_line(e))
            if failures == 3:  # most likely a problem all jobs share: each job will say it in its own line
                log.warning("sweep: the jobs after #%d are not planned", num)
                break
            continue
        names[num] = cfg.sampler.name
        key = (_setup_key(cfg), digest)
        if key in seen:
            first = seen[key]
            out.append({"job": num, "overrides": overrides, "sampler": cfg.sampler.name, "seed": int(cfg.seed),
                        "label": label[num], "same_as_job": first, "same_as": names[first],
                        "same_as_label": label[first]})
        else:
            seen[key] = num
    return out


def check_arms(config: DictConfig, sweep_dir: Path) -> list[dict]:
    """Find the duplicate arms of the sweep about to run, say which, and record them in
    ``<sweep_dir>/duplicates.json`` (an empty list when there are none or the check cannot run)."""
    jobs = job_overrides(config)
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    duplicates: list[dict] = []
    if jobs is None:
        log.info("sweep: identical streams are checked for Hydra's basic sweeper only; not checked here")
    elif target.endswith("SlurmLauncher"):
        log.info("sweep: identical streams are not checked before a Slurm sweep (its stages would be computed on "
                 "this node); `python -m ccexp.plan <the sweep's overrides>` shows them")
    elif len(jobs) > 1:
        duplicates = find_duplicates(config, jobs)
        skip = bool(OmegaConf.select(config, "report.skip_duplicates", default=True))
        for d in duplicates:
            log.warning("sweep: job #%d (%s) would train on the identical token stream as job #%d (%s): %s",
                        d["job"], d["label"], d["same_as_job"], d["same_as_label"],
                        "skipped (report.skip_duplicates=false keeps it)" if skip else "kept (report.skip_duplicates=false)")
        if not duplicates:
            log.info("sweep: the %d jobs' planned token streams all differ (or follow the training loss)", len(jobs))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / DUPLICATES_FILE).write_text(json.dumps(duplicates, indent=1))
    return duplicates


def duplicate_of(job_dir: Path, overrides: list[str]) -> dict | None:
    """The ``duplicates.json`` entry (in the sweep folder above ``job_dir``) for the job with ``overrides``."""
    path = job_dir.parent / DUPLICATES_FILE
    if not path.is_file():
        return None
    return next((d for d in json.loads(path.read_text()) if same_job(d["overrides"], overrides)), None)
