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
import time
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
    were written (``x=false`` and ``x=False``) and in whatever order, leaving out ``report.*`` (how the finished
    runs are compared, nothing a job computes or records: a relaunch asking the report another question keeps the
    jobs that finished)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def computed(key: str) -> bool:
        key = key.lstrip("+~")
        return key != "report" and not key.startswith("report.")

    def normal(overrides: list[str]) -> list[tuple[str, str]]:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        return sorted((o.get_key_element(), o.get_value_element_as_str()) for o in parsed
                      if computed(o.get_key_element()))

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
    composed: dict[tuple[str, ...], DictConfig] = {}  # the jobs' configs but their seed: composed once each
    quiet, start, said = _Quiet(), time.perf_counter(), time.perf_counter()
    try:
        for num, overrides in enumerate(jobs):
            if num == 0:
                quiet.on()
            if num == 1:
                quiet.first = False  # the first job's lines stand for all; later jobs show only what they compute anew
            if time.perf_counter() - said > 15:
                said = time.perf_counter()
                log.warning("sweep: planned the token streams of %d of %d jobs (%.0f s)", num, len(jobs), said - start)
            try:
                cfg = job_config(composed, overrides, compose)
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
    finally:
        quiet.off()
    if len(jobs) > 1:
        log.info("sweep: planned the token streams of %d jobs in %.1f s", len(jobs), time.perf_counter() - start)
    return out


def job_config(composed: dict, overrides: list[str], compose) -> DictConfig:
    """A job's composed config (``compose``: Hydra's, ``composed``: this sweep's compositions so far, filled here). Jobs that differ only in ``seed=<int>`` share one composition: the copy gets its seed
    set, and every setting that follows ``${seed}`` (the sampler's, the initialisation's) follows it, as in a
    composition with that override."""
    import copy

    rest = seedless(overrides)
    if rest is None or rest not in composed:
        cfg = compose(config_name="config", overrides=list(overrides))
        if rest is not None:
            composed[rest] = cfg
        return cfg
    cfg = copy.deepcopy(composed[rest])
    cfg.seed = int(next(o for o in overrides if o.startswith("seed=")).split("=", 1)[1])
    return cfg


def seedless(overrides: list[str]) -> tuple[str, ...] | None:
    """A job's overrides without its ``seed=<int>``, when it has exactly one and its value is a plain integer (jobs
    with equal results compose alike but for the seed); None otherwise (compose that job in full)."""
    seed = [o.split("=", 1)[1] for o in overrides if o.startswith("seed=")]
    if len(seed) != 1 or not seed[0].lstrip("-").isdigit():
        return None
    return tuple(o for o in overrides if not o.startswith("seed="))


class _Quiet(logging.Filter):
    """While the sweep plans its jobs' streams: after the first job, the lines that repeat for every job off (a stage
    read from the cache, the labels, each plan's summary), and each warning said once (a stage's warning about the
    corpus comes with every job that reads the stage); a stage computed now and anything else still show."""

    REPEATS = ("plan: ", "labels: ")

    def __init__(self) -> None:
        from ccexp.plan import SaidOnce

        super().__init__()
        self.first, self.warned = True, SaidOnce()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return self.warned.filter(record)
        message = record.getMessage()
        return self.first or not ("reused=True" in message or message.startswith(self.REPEATS))

    def on(self) -> None:
        log.addFilter(self)

    def off(self) -> None:
        log.removeFilter(self)


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
