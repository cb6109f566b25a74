"""Sweeps through submitit (``hydra/launcher=slurm`` and ``hydra/launcher=local``): the sweep's side, which
waits for every job to end however it ends, and the job's side, which stops on a signal as the command
line does.

The sweep's side. hydra-submitit-launcher waits for each job's result file, so a job that ends without
one — cancelled (``scancel``), stopped at its time limit, on a node that failed, out of memory — raises
in the sweep, which then ends without its summary and report; and where Slurm keeps no accounting
(``sacct`` does not answer, as on ``scripts/slurm_local.sh``'s cluster) such a job is never seen to end.
[`EveryJobEnds`][ccexp.launch.launcher.EveryJobEnds] (the launchers of ``hydra_plugins/ccexp_launcher``) follows the Slurm jobs with
``squeue`` instead — a requeued job is waited for, and said to be —, gives every job a result, and
records the end of a job that left no status of its own ([`record_end`][ccexp.launch.launcher.record_end]: ``status.json`` KILLED
for a cancelled or timed-out job, FAILED otherwise, with its Slurm state and log), so the sweep's
callback ([`ccexp.launch.sweep`][ccexp.launch.sweep]) summarises, reports and closes the parent run as for any sweep.

The job's side. In a job of these launchers ccexp's entry point is called by submitit, not by
[`ccexp.__main__.cli`][ccexp.__main__.cli]: [`catch_signals`][ccexp.launch.launcher.catch_signals] makes SIGTERM and SIGINT stop the run with
[`Interrupted`][ccexp.errors.Interrupted] (submitit would ignore SIGTERM until Slurm's SIGKILL), and
[`end_job`][ccexp.launch.launcher.end_job] ends a stopped job: one ``ccexp:`` line, the signal handed on to submitit where it
listened for it (SIGUSR2: it requeues the job) and exit status ``128 + signal`` without a result file,
so the sweep waits for the requeued job, or sees in Slurm how the job ended.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("ccexp")

# Slurm job states in which a job may still run (or run again): the sweep waits for these
ACTIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
                    "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "POWER_UP_NODE",
                    "SPECIAL_EXIT", "PREEMPTED"})
STOPPED = ("CANCELLED", "TIMEOUT", "PREEMPTED", "DEADLINE")  # ended by a signal or a limit: KILLED, not FAILED
GONE = "ENDED"  # no longer known to squeue (Slurm forgets a job MinJobAge seconds after it ended)


def squeue_states(job_ids: Sequence[str]) -> dict[str, str] | None:
    """Each job's Slurm state (``PENDING``, ``RUNNING``, ``CANCELLED``, ...; array tasks one by one), or
    [`GONE`][ccexp.launch.launcher.GONE] for a job squeue no longer knows; None when squeue does not answer."""
    try:
        proc = subprocess.run(["squeue", "--noheader", "--array", "--states=all", "--format=%i %T",
                               "--jobs=" + ",".join(job_ids)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return {j: GONE for j in job_ids} if "Invalid job id" in proc.stderr else None
    known = dict(line.split()[:2] for line in proc.stdout.splitlines() if len(line.split()) >= 2)
    return {j: known.get(j, GONE) for j in job_ids}


def wait_for_jobs(jobs: list, poll_s: float = 1.0) -> dict[str, str]:
    """Wait until every submitit job has ended: its result file is there, or (Slurm) squeue says it ended,
    or (local) its process exited. Slurm is asked every 2 s at first, every 30 s after ten minutes; a
    requeued job is said once per requeue. Returns each Slurm job's last state."""
    from submitit.slurm.slurm import SlurmJob

    start, asked, states, warned = time.time(), float("-inf"), {}, False
    pending = list(jobs)
    while pending:
        slurm = [j.job_id for j in pending if isinstance(j, SlurmJob) and not j.paths.result_pickle.exists()]
        if slurm and time.time() - asked >= min(30.0, 2.0 + (time.time() - start) / 20):
            asked, found = time.time(), squeue_states(slurm)
            if found is None and not warned:
                log.warning("sweep: squeue does not answer; waiting for the jobs' result files")
            warned = warned or found is None
            for job_id, state in (found or {}).items():
                before = states.get(job_id)  # a requeued job goes back from COMPLETING (or RUNNING) to PENDING or RUNNING
                if before == "COMPLETING" and state in ACTIVE - {"COMPLETING"} or \
                        before == "RUNNING" and state.startswith(("PENDING", "REQUEUE")):
                    log.info("sweep: Slurm job %s was requeued (%s)", job_id, state)
                states[job_id] = state
        pending = [j for j in pending if not j.paths.result_pickle.exists() and (
            states.get(j.job_id, "PENDING") in ACTIVE if isinstance(j, SlurmJob) else not j.done())]
        if pending:
            time.sleep(poll_s)
    return states


def _result_file(job, grace_s: float = 5.0) -> bool:
    """True when the job's result file is there, waiting up to ``grace_s`` for a shared file system to show it."""
    deadline = time.time() + grace_s
    while True:
        try:
            job.paths.folder.chmod(job.paths.folder.stat().st_mode)  # refreshes an NFS client's view (as submitit)
        except OSError:
            pass
        if job.paths.result_pickle.exists() or time.time() >= deadline:
            return job.paths.result_pickle.exists()
        time.sleep(0.5)


def record_end(job_dir: Path, overrides: list[str], job_id: str, state: str, why: str, log_file: Path) -> str:
    """Record in ``<job_dir>/status.json`` how a job that gave no result ended; return its status.

    A FINISHED or SKIPPED job is left as it is; a KILLED or FAILED one keeps its own line, with the Slurm
    state after it; a job that left no status (it never started, or was killed hard) gets KILLED when
    Slurm stopped it (``scancel``, its time limit, a preemption), else FAILED, with the state and its log.
    Hydra's ``.hydra/overrides.yaml`` is written for a job that never started, so the sweep lists it."""
    from ccexp.launch.status import STATUS_FILE, write_job_status

    path = job_dir / STATUS_FILE
    old = json.loads(path.read_text()) if path.is_file() else {}
    if old.get("status") in ("FINISHED", "SKIPPED"):
        return old["status"]
    ended = f"Slurm job {job_id} ended {state}" if state and state != GONE else f"job {job_id} ended"
    if old.get("status") in ("KILLED", "FAILED"):
        status, message = old["status"], f"{old['message']} ({ended})"
    else:
        status = "KILLED" if state.startswith(STOPPED) else "FAILED"
        message = f"{ended} without finishing{': ' + why if why else ''}; its log: {log_file}"
    hydra_dir = job_dir / ".hydra"
    if not (hydra_dir / "overrides.yaml").is_file():
        import yaml

        hydra_dir.mkdir(parents=True, exist_ok=True)
        (hydra_dir / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    write_job_status(job_dir, status, message, overrides)
    log.warning("sweep: %s: %s", job_dir.name, message)
    return status


def submit(executor, function, params: list[tuple]) -> list:
    """``executor.map_array``: the sweep's jobs submitted (a Slurm job array).

    Raises:
        CcexpError: when sbatch refuses them (a partition, CPU count, memory or time the cluster does not have).
    """
    from submitit.core.utils import FailedJobError

    from ccexp.errors import CcexpError

    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal too: it is in the one line
            return executor.map_array(function, *zip(*params))
    except FailedJobError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "error" in ln.lower() and ln.strip()]
        raise CcexpError(f"sbatch refused the sweep's jobs ({lines[-1] if lines else str(e)[:300]}); ask for what the "
                         "cluster has (sinfo lists its partitions, CPUs and memory): hydra.launcher.partition, "
                         "cpus_per_task, mem_gb, gpus_per_node, timeout_min") from None


class EveryJobEnds:
    """hydra-submitit-launcher's ``launch`` (1.2), waiting for every job's end with [`wait_for_jobs`][ccexp.launch.launcher.wait_for_jobs]
    and returning a result for every job (see the module docstring); mixed into its launchers by
    ``hydra_plugins/ccexp_launcher``."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        assert self.config is not None and len(job_overrides) > 0
        specific = {"max_num_timeout"}
        init = {"folder": self.params["submitit_folder"],
                **{f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in specific}}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in self.params.items()
                                      if k not in specific | {"submitit_folder"}})
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = submit(executor, self, params)
        log.info("sweep: %d job(s) submitted: %s", len(jobs), " ".join(j.job_id for j in jobs))
        states = wait_for_jobs(jobs)
        return [self._job_return(job, list(overrides), states.get(job.job_id, ""))
                for job, overrides in zip(jobs, job_overrides)]

    def _job_return(self, job, overrides: list[str], state: str):
        """The job's own result; for a job without one (or whose entry point raised), its end recorded
        ([`record_end`][ccexp.launch.launcher.record_end]) and a result Hydra's sweeper accepts, so the sweep goes on to its end."""
        from hydra.core.utils import JobReturn, JobStatus

        why = ""
        try:
            if _result_file(job, grace_s=5.0 if state else 0.0):
                ret = job.results()[0]
                if ret.status != JobStatus.FAILED:
                    return ret
                why = f"{type(ret._return_value).__name__}: {ret._return_value}"
        except Exception as e:  # submitit's FailedJobError: the job's process failed outside ccexp's entry point
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = lines[-1] if lines else type(e).__name__
        record_end(self._job_dir(overrides), overrides, job.job_id, state, why, job.paths.stderr)
        return JobReturn(overrides=overrides, status=JobStatus.COMPLETED, _return_value=float("nan"))

    def _job_dir(self, overrides: list[str]) -> Path:
        """The folder the job with ``overrides`` has (or would have had) in this sweep."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)


# -- the job's side -----------------------------------------------------------------------------------
def in_launcher_job() -> bool:
    """True in a job process of ``hydra/launcher=slurm|local`` (submitit sets ``SUBMITIT_FOLDER`` there)."""
    return "SUBMITIT_FOLDER" in os.environ


def catch_signals() -> None:
    """SIGTERM and SIGINT raise [`Interrupted`][ccexp.errors.Interrupted], as under the command line (training
    replaces them to stop at the end of a step); submitit's SIGUSR2 handler stays."""
    import signal

    from ccexp.errors import raise_interrupted

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, raise_interrupted)


def end_job(stop) -> None:
    """End a job stopped by a signal (``stop``, an [`Interrupted`][ccexp.errors.Interrupted], its status already
    written): its one line, the signal handed on to its listener (submitit requeues the job and exits),
    then exit ``128 + signal`` — no result file, so the sweep waits for a requeued job.

    Raises:
        SystemExit: always.
    """
    import signal

    line = f"ccexp: {stop}" + ("" if "checkpoint" in str(stop) else "; finished stages stay cached, unfinished "
                               "ones were discarded")
    log.warning("%s", line)
    print(line, file=sys.stderr, flush=True)
    for signum in (signal.SIGTERM, signal.SIGINT):  # the requeue's own SIGTERM may not cut this short
        signal.signal(signum, signal.SIG_IGN)
    if stop.pass_on is not None:
        try:
            stop.pass_on(stop.signum, None)  # submitit: requeues the job (scontrol requeue) and exits
        except Exception as e:  # not requeued: it timed out max_num_timeout times, or the call cannot be resubmitted
            log.warning("ccexp: the job is not requeued: %s", e)
    raise SystemExit(stop.exit_code)

