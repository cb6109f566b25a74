"""Sweeps on a real Slurm cluster (``scripts/slurm_local.sh start``; tests marked ``slurm``, skipped without
one): the README's Slurm sweep through sbatch, and the faults a cluster brings — a job requeued with
``scontrol requeue``, the notice before a time limit (SIGUSR2, which submitit asks Slurm to send), a job
cancelled with ``scancel``, a bad job among good ones — each ending with nothing lost: a stopped job
resumes from its own checkpoint to the same final weights and held-out scores as an uninterrupted run,
and a job that cannot finish is KILLED or FAILED in MLflow, in its status and in the sweep's summary and
report. Every sweep is TINY (20 steps on 300 documents); the uninterrupted references are the README
sweep's jobs, run once per module. The first tests (no cluster needed) check the parts one by one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from test_cases import CASES, TINY

# the README's Slurm sweep on TINY settings (periodic checkpoints: a fault waits for the first one)
SWEEP = [*TINY, f"data.path={CASES / 'tiny.jsonl'}", "train.checkpoint_every_n_steps=5", "train.resume_from=auto"]
STEPS = 20


# -- the parts, without a cluster --------------------------------------------------------------------
def test_the_local_cluster_script_says_in_one_line_that_slurm_is_not_installed(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash",):
        (bin_dir / tool).symlink_to(subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True,
                                                   text=True).stdout.strip())
    proc = subprocess.run([str(bin_dir / "bash"), str(ROOT / "scripts" / "slurm_local.sh"), "start", str(tmp_path / "c")],
                          env={"PATH": str(bin_dir), "SLURM_SBIN": str(tmp_path / "none")}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["slurm_local.sh: error: Slurm is not installed here (no slurmctld slurmd munged "
                                        "sinfo squeue sbatch scontrol scancel); on Debian or Ubuntu: apt-get install "
                                        "slurm-wlm munge"]
    assert not (tmp_path / "c").exists()  # nothing written


def fake_slurm(tmp_path: Path) -> Path:
    """A folder of stand-ins for Slurm's commands (the script only looks them up), with bash beside them."""
    bin_dir = tmp_path / "fake-slurm"
    bin_dir.mkdir()
    for name in ("slurmctld", "slurmd", "munged", "sinfo", "squeue", "sbatch", "scontrol", "scancel"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    for tool in ("bash", "tr", "grep", "id", "hostname", "seq", "sleep", "mkdir"):
        (bin_dir / tool).symlink_to(subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True,
                                                   text=True).stdout.strip())
    return bin_dir


def test_the_local_cluster_script_says_what_it_needs_and_what_is_not_running(tmp_path):
    bin_dir = fake_slurm(tmp_path)
    script, folder = str(ROOT / "scripts" / "slurm_local.sh"), str(tmp_path / "c")
    env = {"PATH": str(bin_dir), "SLURM_SBIN": str(tmp_path / "none")}

    def run(*args: str, user: list[str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*(user or []), f"{env['PATH']}/bash", script, *args], env=env, capture_output=True,
                              text=True, timeout=60)

    usage = run("restart")
    assert usage.returncode == 2 and usage.stderr == "usage: slurm_local.sh start|stop|status [FOLDER] (default /tmp/ccexp-slurm)\n"
    status = run("status", folder)
    assert status.returncode == 1 and status.stderr == (f"slurm_local.sh: no cluster of {folder} is running (start one "
                                                        f"with: sudo scripts/slurm_local.sh start {folder})\n")
    stop = run("stop", folder)
    assert stop.returncode == 0 and stop.stdout == f"slurm_local.sh: nothing of {folder} was running\n"
    import shutil
    import tempfile

    if os.getuid() == 0 and shutil.which("setpriv"):  # the refusal to start without root, as nobody
        with tempfile.TemporaryDirectory(dir="/tmp") as shared:  # a folder nobody can reach (pytest's is root's)
            os.chmod(shared, 0o755)
            bin_dir = fake_slurm(Path(shared))
            folder = f"{shared}/c"
            os.mkdir(folder, 0o777)
            os.chmod(folder, 0o777)
            env["PATH"] = str(bin_dir)
            as_user = run("start", folder, user=[shutil.which("setpriv"), "--reuid=65534", "--regid=65534",
                                                 "--clear-groups"])
            assert as_user.returncode == 1 and as_user.stderr == (
                "slurm_local.sh: error: start needs root (slurmd starts each job as the user who submitted it): "
                f"sudo {script} start {folder}\n")
            assert os.listdir(folder) == []  # nothing written


def test_squeue_states_reads_each_job_and_calls_a_forgotten_one_ended(tmp_path, monkeypatch):
    from ccexp.launch.launcher import GONE, squeue_states

    fake = tmp_path / "squeue"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *99*) echo 'slurm_load_jobs error: Invalid job id specified' >&2; "
                    "exit 1;; esac\nprintf '12_0 RUNNING\\n12_1 CANCELLED\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert squeue_states(["12_0", "12_1", "12_2"]) == {"12_0": "RUNNING", "12_1": "CANCELLED", "12_2": GONE}
    assert squeue_states(["99"]) == {"99": GONE}
    fake.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1\n")
    assert squeue_states(["12_0"]) is None  # no answer: the sweep keeps waiting


def test_the_sweep_waits_for_a_slurm_job_when_squeue_does_not_answer(tmp_path, monkeypatch, caplog):
    import threading

    from submitit.slurm.slurm import SlurmJob

    from ccexp.launch.launcher import wait_for_jobs

    fake = tmp_path / "squeue"
    fake.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    job = SlurmJob(folder=tmp_path / "jobs" / "%j", job_id="5_0")
    job.paths.folder.mkdir(parents=True)
    threading.Timer(2.5, job.paths.result_pickle.write_bytes, [b"x"]).start()  # the job's result, later
    with caplog.at_level("INFO", logger="ccexp"):
        assert wait_for_jobs([job], poll_s=0.2) == {}
    assert [r.getMessage() for r in caplog.records] == ["sweep: squeue does not answer; waiting for the jobs' result files"]


def test_a_job_that_is_not_requeued_says_so_and_exits_without_a_result(capsys, caplog):
    from submitit.core.utils import UncompletedJobError

    from ccexp.errors import Interrupted
    from ccexp.launch.launcher import end_job

    def submitit_gives_up(signum, frame):
        raise UncompletedJobError("Job not requeued because: timed-out too many times.")

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level("WARNING", logger="ccexp"), pytest.raises(SystemExit) as ended:
            end_job(Interrupted(signal.SIGUSR2, "stopped by SIGUSR2 after step 6, ... the checkpoint is x.ckpt",
                                pass_on=submitit_gives_up))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert ended.value.code == 140
    assert capsys.readouterr().err == "ccexp: stopped by SIGUSR2 after step 6, ... the checkpoint is x.ckpt\n"
    assert caplog.records[-1].getMessage() == ("ccexp: the job is not requeued: Job not requeued because: timed-out too "
                                               "many times.")


def test_a_job_that_ended_without_a_result_is_recorded_and_listed_by_the_sweep(tmp_path):
    from ccexp.launch.launcher import record_end
    from ccexp.launch.sweep import job_statuses, write_job_status

    sweep = tmp_path / "sweep"
    never = sweep / "random-s0-aaaaaa"  # cancelled while pending: no folder at all
    assert record_end(never, ["sampler=random"], "7_0", "CANCELLED", "", tmp_path / "7_0_0_log.err") == "KILLED"
    stopped = sweep / "uniform-s0-bbbbbb"  # stopped by SIGTERM: its own line, then Slurm's state
    (stopped / ".hydra").mkdir(parents=True)
    (stopped / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["sampler=uniform"]))
    write_job_status(stopped, "KILLED", "stopped by SIGTERM after step 8", ["sampler=uniform"])
    assert record_end(stopped, ["sampler=uniform"], "7_1", "CANCELLED", "", tmp_path / "log") == "KILLED"
    lost = sweep / "clusterclip-s0-cccccc"  # killed hard on a node that failed
    assert record_end(lost, ["sampler=clusterclip"], "7_2", "NODE_FAIL", "", tmp_path / "7_2_0_log.err") == "FAILED"
    done = sweep / "random-s1-dddddd"
    (done / ".hydra").mkdir(parents=True)
    write_job_status(done, "FINISHED", "", ["seed=1"])
    assert record_end(done, ["seed=1"], "7_3", "COMPLETED", "", tmp_path / "log") == "FINISHED"
    statuses = {job: (status, message) for job, _, status, message in job_statuses(sweep)}
    assert statuses["random-s0-aaaaaa"] == ("KILLED", f"Slurm job 7_0 ended CANCELLED without finishing; its log: "
                                                      f"{tmp_path / '7_0_0_log.err'}")
    assert statuses["uniform-s0-bbbbbb"] == ("KILLED", "stopped by SIGTERM after step 8 (Slurm job 7_1 ended CANCELLED)")
    assert statuses["clusterclip-s0-cccccc"][0] == "FAILED" and "ended NODE_FAIL" in statuses["clusterclip-s0-cccccc"][1]
    assert statuses["random-s1-dddddd"] == ("FINISHED", "")


def test_a_run_left_running_by_a_killed_job_is_closed_at_the_sweeps_end(tmp_path, caplog):
    from mlflow import MlflowClient

    from ccexp.tracking.mlflow_run import ensure_experiment, open_store
    from ccexp.launch.sweep import close_left_running

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = open_store(uri)
    exp = ensure_experiment(client, "ccexp", tmp_path / "mlartifacts")
    runs = {name: client.create_run(exp, run_name=name).info.run_id for name in ("a", "b", "c")}
    for name, job in (("a", "random-s0-1"), ("b", "uniform-s0-2"), ("c", "clusterclip-s0-3")):
        (tmp_path / "sweep" / job).mkdir(parents=True)
        (tmp_path / "sweep" / job / "run.json").write_text(json.dumps({"mlflow_run_id": runs[name]}))
    with caplog.at_level("WARNING", logger="ccexp"):
        close_left_running(uri, tmp_path / "sweep", [("random-s0-1", "", "KILLED", "Slurm job 3_0 ended CANCELLED"),
                                                     ("uniform-s0-2", "", "FAILED", "job 3_1 ended"),
                                                     ("clusterclip-s0-3", "", "FINISHED", "")])
    assert "mlflow: the run of job random-s0-1 was left RUNNING by its job (Slurm job 3_0 ended CANCELLED): closed " \
           "KILLED" in [r.getMessage() for r in caplog.records]
    client = MlflowClient(uri)
    assert [client.get_run(runs[n]).info.status for n in "abc"] == ["KILLED", "FAILED", "RUNNING"]
    assert client.get_run(runs["a"]).data.tags["error"] == "Slurm job 3_0 ended CANCELLED"


def test_the_notice_before_a_time_limit_stops_training_at_a_step_end_and_is_handed_on(tmp_path):
    """SIGUSR2, which submitit listens for in a Slurm job: training stops at the end of the step with a
    checkpoint, and the Interrupted it raises carries submitit's handler for the entry point to call."""
    from types import SimpleNamespace

    from ccexp.errors import Interrupted
    from ccexp.training.callbacks import StopOnSignal

    heard = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR2, lambda signum, frame: heard.append(signum))  # submitit's, in a job
    try:
        stop = StopOnSignal(tmp_path / "last.ckpt")
        saved = []
        trainer = SimpleNamespace(global_step=7, world_size=1, save_checkpoint=lambda path, weights_only: saved.append(path))
        module = SimpleNamespace(device="cpu")
        stop.on_train_start(trainer, module)
        os.kill(os.getpid(), signal.SIGUSR2)
        stop.on_train_batch_end(trainer, module, None, {"last_micro": False}, 0)  # mid-accumulation: goes on
        assert saved == [] and heard == []
        with pytest.raises(Interrupted) as caught:
            stop.on_train_batch_end(trainer, module, None, {"last_micro": True}, 0)
        assert saved == [tmp_path / "last.ckpt"]
        assert str(caught.value).startswith("stopped by SIGUSR2 after step 7, the scheduler's notice of the job's time "
                                            "limit (or of a preemption); the checkpoint is ")
        stop.on_exception(trainer, module, caught.value)
        caught.value.pass_on(signal.SIGUSR2, None)  # what the entry point does once the run is closed
        assert heard == [signal.SIGUSR2] and caught.value.exit_code == 140
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert StopOnSignal(tmp_path / "x.ckpt").pass_on is None  # without a listener SIGUSR2 is not taken


# -- on a real cluster ---------------------------------------------------------------------------------
def launcher(cluster: dict) -> list[str]:
    """hydra/launcher=slurm sized for the local cluster: one CPU and no GPU per job, no memory request, a
    10-minute limit (its notice, SIGUSR2, a minute before)."""
    return ["hydra/launcher=slurm", f"hydra.launcher.partition={cluster['partition']}", "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.gpus_per_node=0", "hydra.launcher.mem_gb=null", "hydra.launcher.timeout_min=10",
            "hydra.launcher.signal_delay_s=60"]


class Sweep:
    """``python -m ccexp -m <launcher> <SWEEP> ...`` started in the background (its stdout and stderr in files)."""

    def __init__(self, tmp_path: Path, cluster: dict, cache: Path, *overrides: str):
        self.out, self.t0 = tmp_path / "out", time.time()
        self.stdout, self.stderr = tmp_path / "sweep.out", tmp_path / "sweep.err"
        args = [sys.executable, "-m", "ccexp", "-m", *launcher(cluster), *SWEEP, f"paths.outputs={self.out}",
                f"paths.cache={cache}", *overrides]
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.proc = subprocess.Popen(args, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                                         stdout=out, stderr=err, text=True)

    def job(self, override: str, timeout: float = 600) -> Path:
        """The folder of the job whose overrides hold ``override``, once Hydra has made it."""
        deadline = time.time() + timeout
        while True:
            for path in self.out.glob("multirun/*/*/*/.hydra/overrides.yaml"):
                if override in (yaml.safe_load(path.read_text()) or []):
                    return path.parent.parent
            assert self.proc.poll() is None, self.log()[-3000:]
            assert time.time() < deadline, f"no job with {override}"
            time.sleep(0.2)

    def wait_for(self, path: Path, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while not path.exists():
            assert self.proc.poll() is None, self.log()[-3000:]
            assert time.time() < deadline, f"{path} did not appear"
            time.sleep(0.1)

    def finish(self, timeout: float = 900, release: str | None = None) -> int:
        """Wait for the sweep's end; Slurm holds a requeued job ``release`` two minutes (BeginTime): let it
        start at once (``scontrol update StartTime=now``), as the cluster would later. Returns the releases."""
        deadline, released, held = time.time() + timeout, 0, False
        while self.proc.poll() is None:
            assert time.time() < deadline, self.log()[-3000:]
            if release:
                state = subprocess.run(["squeue", "--noheader", "--jobs", release, "--format=%T %r"], capture_output=True,
                                       text=True).stdout.strip()
                if state == "PENDING BeginTime" and not held:
                    subprocess.run(["scontrol", "update", f"JobId={release}", "StartTime=now"], check=True)
                    released += 1
                held = state == "PENDING BeginTime"
            time.sleep(0.5)
        self.seconds = time.time() - self.t0
        print(f"sweep: {self.seconds:.0f} s")
        return released

    def log(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()


def slurm_id(job: Path) -> str:
    return json.loads((job / "run.json").read_text())["slurm_job_id"]


def job_log(job: Path) -> str:
    """What the job's Slurm task wrote (submitit's stdout and stderr, every attempt)."""
    folder = next(job.parent.glob(".submitit")) / slurm_id(job)
    return "".join(p.read_text() for p in sorted(folder.glob("*_log.*")))


def mlflow_runs(out: Path) -> tuple:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp")
    runs = client.search_runs([exp.experiment_id])
    return [r for r in runs if r.data.tags.get("ccexp.sweep") == "true"], \
        {r.data.tags["run_dir"]: r for r in runs if r.data.tags.get("ccexp.sweep") != "true"}


def assert_same_end(job: Path, reference: Path, out: Path, reference_out: Path) -> None:
    """The final checkpoint's weights, tensor by tensor, the held-out scores of every document and the
    run's eval metrics equal the uninterrupted reference's."""
    import torch

    a, b = (torch.load(j / "checkpoints" / f"step-{STEPS}.ckpt", map_location="cpu", weights_only=True)["state_dict"]
            for j in (job, reference))
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert (job / "tables" / "heldout_documents.csv").read_text() == \
        (reference / "tables" / "heldout_documents.csv").read_text()
    (mine,), (theirs,) = ([r for d, r in mlflow_runs(o)[1].items() if d == str(j)] for o, j in
                          ((out, job), (reference_out, reference)))
    metrics = {k: v for k, v in mine.data.metrics.items() if k.startswith("eval/") or k == "train/tokens"}
    assert metrics == {k: v for k, v in theirs.data.metrics.items() if k in metrics} and len(metrics) > 10
    assert metrics["train/tokens"] == STEPS * 512


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One stage cache for the module's sweeps (the corpus, tokenizer, embedding and clustering once)."""
    return tmp_path_factory.mktemp("slurm-cache")


@pytest.fixture(scope="module")
def readme_sweep(slurm_cluster, cache, tmp_path_factory) -> Sweep:
    """The README's Slurm sweep (``sampler=random,uniform,clusterclip train.resume_from=auto``), uninterrupted:
    the reference of the faults below."""
    sweep = Sweep(tmp_path_factory.mktemp("readme"), slurm_cluster, cache, "sampler=random,uniform,clusterclip")
    sweep.finish()
    return sweep


@pytest.mark.slow
@pytest.mark.slurm
def test_a_slurm_job_runs_with_the_submitters_python_and_this_checkouts_ccexp(slurm_cluster, tmp_path):
    code = "import ccexp, sys; print(ccexp.__file__, sys.executable)"
    proc = subprocess.run(["sbatch", "--wait", "--quiet", f"--partition={slurm_cluster['partition']}", "--cpus-per-task=1",
                           f"--output={tmp_path / 'job.out'}", f"--wrap={sys.executable} -c '{code}'"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "job.out").read_text().split() == [str(ROOT / "ccexp" / "__init__.py"), sys.executable]


@pytest.mark.slow
@pytest.mark.slurm
def test_the_readmes_slurm_sweep_runs_every_job_through_sbatch_to_one_parent_and_a_report(readme_sweep):
    sweep = readme_sweep
    assert sweep.proc.returncode == 0, sweep.log()[-3000:]
    (folder,) = sweep.out.glob("multirun/*/*")
    jobs = sorted(p.parent for p in folder.glob("*/status.json"))
    assert [j.name.split("-")[0] for j in jobs] == ["clusterclip", "random", "uniform"]
    assert all(json.loads((j / "status.json").read_text())["status"] == "FINISHED" for j in jobs)
    submitted = next(ln for ln in sweep.log().splitlines() if "sweep: 3 job(s) submitted: " in ln).split(": ")[-1].split()
    assert sorted(slurm_id(j) for j in jobs) == sorted(submitted) and submitted[0].endswith("_0")  # one job array
    script = next(folder.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --cpus-per-task=1" in script and "#SBATCH --signal=USR2@60" in script and "srun " in script
    parents, children = mlflow_runs(sweep.out)
    assert [p.info.status for p in parents] == ["FINISHED"]
    assert sorted((r.data.tags["sampler"], r.info.status) for r in children.values()) == [
        ("clusterclip", "FINISHED"), ("random", "FINISHED"), ("uniform", "FINISHED")]
    assert {r.data.tags["mlflow.parentRunId"] for r in children.values()} == {parents[0].info.run_id}
    assert {r.data.tags["slurm_job_id"] for r in children.values()} == set(submitted)
    assert "sweep: 3 of 3 job(s) finished" in sweep.log()
    assert "ccexp comparison: 3 runs" in (folder / "report" / "report.md").read_text()
    assert "Jobs that did not finish" not in (folder / "report" / "report.md").read_text()
    assert "Bypassing sacct error" not in sweep.log()  # the sweep follows its jobs with squeue


@pytest.mark.slow
@pytest.mark.slurm
def test_a_requeued_job_resumes_from_its_own_checkpoint_and_ends_as_the_uninterrupted_run(
        readme_sweep, slurm_cluster, cache, tmp_path):
    sweep = Sweep(tmp_path, slurm_cluster, cache, "sampler=random")
    job = sweep.job("sampler=random")
    sweep.wait_for(job / "checkpoints" / "step-5.ckpt")
    subprocess.run(["scontrol", "requeue", slurm_id(job)], check=True)
    assert sweep.finish(release=slurm_id(job)) == 1
    assert sweep.proc.returncode == 0, sweep.log()[-3000:]
    log = job_log(job)
    stopped = int(log.split("ccexp: stopped by SIGTERM after step ")[1].split(";")[0])
    assert 5 <= stopped < STEPS
    assert f"resume: train.resume_from=auto is {job}/checkpoints/last.ckpt" in log
    assert f"resume: continuing after step {stopped} from {job}/checkpoints/last.ckpt" in log
    assert "Traceback" not in log and "Exited with exit code 143" in log
    assert f"sweep: Slurm job {slurm_id(job)} was requeued" in sweep.log()
    (run,) = mlflow_runs(sweep.out)[1].values()  # the interrupted run continued, not a second one
    assert (run.info.status, run.data.tags["resumed"]) == ("FINISHED", "1")
    assert json.loads((job / "status.json").read_text())["status"] == "FINISHED"
    reference = readme_sweep.job("sampler=random")
    assert_same_end(job, reference, sweep.out, readme_sweep.out)


@pytest.mark.slow
@pytest.mark.slurm
def test_the_notice_before_the_time_limit_leaves_a_checkpoint_and_the_requeued_job_ends_as_uninterrupted(
        readme_sweep, slurm_cluster, cache, tmp_path):
    """SIGUSR2, which Slurm sends signal_delay_s before the time limit (``--signal=USR2@60``), sent now with
    ``scancel --signal=USR2``: ccexp checkpoints at the step's end, submitit requeues the job, it resumes
    from that checkpoint."""
    sweep = Sweep(tmp_path, slurm_cluster, cache, "sampler=uniform")
    job = sweep.job("sampler=uniform")
    sweep.wait_for(job / "checkpoints" / "step-5.ckpt")
    subprocess.run(["scancel", "--signal=USR2", slurm_id(job)], check=True)
    assert sweep.finish(release=slurm_id(job)) == 1
    assert sweep.proc.returncode == 0, sweep.log()[-3000:]
    log = job_log(job)
    stopped = int(log.split("ccexp: stopped by SIGUSR2 after step ")[1].split(",")[0])
    assert 5 <= stopped < STEPS
    assert f"the checkpoint is {job}/checkpoints/last.ckpt: the requeued job continues from it" in log
    assert f"Requeued job {slurm_id(job)} (2 remaining timeouts)" in log  # submitit's requeue, counted
    assert f"resume: continuing after step {stopped} from {job}/checkpoints/last.ckpt" in log  # the stop's own
    (run,) = mlflow_runs(sweep.out)[1].values()
    assert (run.info.status, run.data.tags["resumed"]) == ("FINISHED", "1")
    reference = readme_sweep.job("sampler=uniform")
    assert_same_end(job, reference, sweep.out, readme_sweep.out)


@pytest.fixture(scope="module")
def faulty_sweep(slurm_cluster, cache, tmp_path_factory) -> tuple[Sweep, dict[str, Path]]:
    """ClusterClip with clip_threshold 0 (refused: a bad job), 5 (cancelled with scancel after its first
    checkpoint) and 6 (left alone), in one sweep."""
    sweep = Sweep(tmp_path_factory.mktemp("faulty"), slurm_cluster, cache, "sampler=clusterclip",
                  "sampler.clip_threshold=0,5,6")
    cancelled = sweep.job("sampler.clip_threshold=5")
    sweep.wait_for(cancelled / "checkpoints" / "step-5.ckpt")
    subprocess.run(["scancel", slurm_id(cancelled)], check=True)
    sweep.finish()
    return sweep, {f"clip{c}": sweep.job(f"sampler.clip_threshold={c}") for c in (0, 5, 6)}


@pytest.mark.slow
@pytest.mark.slurm
def test_a_scancelled_job_is_killed_in_mlflow_and_named_in_the_summary_and_the_report(faulty_sweep):
    sweep, jobs = faulty_sweep
    job = jobs["clip5"]
    status = json.loads((job / "status.json").read_text())
    assert status["status"] == "KILLED" and status["message"].startswith("stopped by SIGTERM after step ")
    assert status["message"].endswith(f"(Slurm job {slurm_id(job)} ended CANCELLED)")
    assert "Exited with exit code 143" in job_log(job) and "Traceback" not in job_log(job)
    parents, children = mlflow_runs(sweep.out)
    assert children[str(job)].info.status == "KILLED" and [p.info.status for p in parents] == ["FAILED"]
    assert all(r.info.status != "RUNNING" for r in [*parents, *children.values()])  # nothing left RUNNING
    (line,) = [ln for ln in sweep.stderr.read_text().splitlines() if ln.startswith("ccexp:")]
    assert sweep.proc.returncode == 1 and line.startswith("ccexp: error: 2 sweep job(s) failed: ")
    assert f"#{job.name} (sampler.clip_threshold=5): {status['message']}" in line
    assert f"sweep: 1 of 3 job(s) finished; failed: " in sweep.log()
    report = (job.parent / "report" / "report.md").read_text()
    assert f"- #{job.name} (sampler.clip_threshold=5): KILLED: {status['message']}" in report


@pytest.mark.slow
@pytest.mark.slurm
def test_a_bad_job_fails_in_its_own_log_with_its_line_and_the_others_run(faulty_sweep):
    sweep, jobs = faulty_sweep
    bad, good = jobs["clip0"], jobs["clip6"]
    message = "sampler.clip_threshold must be an integer >= 1, got 0"
    assert json.loads((bad / "status.json").read_text()) | {"overrides": []} == {
        "status": "FAILED", "message": message, "overrides": []}
    assert f"ccexp: error: {message}" in (bad / "ccexp.log").read_text()
    assert message not in (good / "ccexp.log").read_text()
    assert json.loads((good / "status.json").read_text())["status"] == "FINISHED"
    assert (jobs["clip5"] / "checkpoints" / "step-5.ckpt").is_file()  # the cancelled one had trained too
    _, children = mlflow_runs(sweep.out)
    assert children[str(good)].info.status == "FINISHED" and str(bad) not in children  # refused before any run
    (line,) = [ln for ln in sweep.stderr.read_text().splitlines() if ln.startswith("ccexp:")]
    assert f"#{bad.name} (sampler.clip_threshold=0): {message}" in line
    report = (bad.parent / "report" / "report.md").read_text()
    assert "ccexp comparison: 1 run" in report and f"- #{bad.name} (sampler.clip_threshold=0): FAILED: {message}" in report


@pytest.mark.slow
@pytest.mark.slurm
def test_a_sweep_asking_for_more_than_the_cluster_has_is_refused_in_one_line(slurm_cluster, cache, tmp_path):
    sweep = Sweep(tmp_path, slurm_cluster, cache, "sampler=random", f"hydra.launcher.cpus_per_task={slurm_cluster['cpus'] + 1}")
    sweep.finish(timeout=300)
    assert sweep.proc.returncode == 2
    assert sweep.stderr.read_text().splitlines() == [
        "ccexp: error: sbatch refused the sweep's jobs (sbatch: error: Batch job submission failed: More processors "
        "requested than permitted); ask for what the cluster has (sinfo lists its partitions, CPUs and memory): "
        "hydra.launcher.partition, cpus_per_task, mem_gb, gpus_per_node, timeout_min"]
    parents, _ = mlflow_runs(sweep.out)
    assert [p.info.status for p in parents] == ["FAILED"]  # closed, not left RUNNING
