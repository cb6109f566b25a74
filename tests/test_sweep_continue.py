"""A sweep you can stop and continue (c43, c44 of ``shared/cases/round5``): a packed sweep stopped by a signal stops
each training job at its step's end with its checkpoint and says what is left and the command that continues it;
the same command again continues that sweep folder (finished jobs kept, each stopped job from its own checkpoint);
a sweep job never takes another sweep's run for its own; the commands a report prints keep the sweep's launcher,
and how many cores a run had is not a setting that splits a comparison."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from omegaconf import OmegaConf

from warm import python_m
from conftest import ROOT
from test_cases import CASES

SMALL = ["data=jsonl", "data.label_fields=[domain]", "clusterer.k=2", "train.tokens_per_step=512",
         "train.micro_batch_size=8", "train.seq_len=64", "eval.max_tokens=63", "model.n_positions=64",
         "model.tokenizer.vocab_size=512", "trainer.enable_progress_bar=false"]


def checkpoint(path: Path) -> Path:
    """A file that reads as a whole checkpoint (a zip archive, as Lightning's are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("data.pkl", b"x")
    return path


def run_folder(folder: Path, digest: str, status: str, step: int, with_checkpoint: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps({"run_name": "random-k2-s0-abcd", "config_digest": digest,
                                                 "status": status, "step": step, "steps": 80,
                                                 "started": time.time() - (10 if status == "finished" else 20)}))
    if with_checkpoint:
        checkpoint(folder / "checkpoints" / "last.ckpt")
    return folder


def training_jobs(out: Path) -> int:
    """How many job folders of the sweep under ``out`` have logged a training step (each job's own ccexp.log)."""
    return sum("train: step " in (d / "ccexp.log").read_text() for d in (out / "multirun").glob("*/*/*-s*-*")
               if (d / "ccexp.log").is_file())


def interrupted_sweep(args: list[str], out: Path, log: Path) -> tuple[str, Path]:
    """Start ``python -m ccexp <args>``, send it SIGINT once two of its jobs train at once, and return its output
    (after asserting exit 130) and its sweep folder."""
    proc = subprocess.Popen([sys.executable, "-m", "ccexp", *args], cwd=ROOT, env={**os.environ,
                            "PYTHONWARNINGS": "ignore"}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 400
    while training_jobs(out) < 2:  # both jobs at once past their first step
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130, log.read_text()[-3000:]
    return log.read_text(), next((out / "multirun").glob("*/*/sweep.json")).parent


@pytest.mark.parametrize("resume_from", [None, "auto", "last"])
def test_a_sweep_job_continues_its_own_checkpoint_and_never_another_sweeps_run(tmp_path, resume_from):
    """Relaunched into its folder, a stopped job continues from its own checkpoint, even when a run of the same
    settings finished in another sweep folder (which used to make it train nothing and leave no status)."""
    from ccexp.launch.resume import find_resume
    from ccexp.names import RunIdentity

    digest = "d" * 64
    identity = RunIdentity("random-k2-s0-abcd", digest)
    out = tmp_path / "out"
    run_folder(out / "multirun" / "2026-12-07" / "later" / "random-s0-aaaaaa", digest, "finished", 80, False)
    own = run_folder(out / "multirun" / "2026-12-07" / "first" / "random-s0-aaaaaa", digest, "stopped", 12, True)
    found = find_resume(resume_from, identity, own, out, multirun=True)
    assert found.finished is None
    assert found.checkpoint == str(own / "checkpoints" / "last.ckpt")
    # a job whose own folder holds nothing starts fresh, whatever another sweep's folder holds
    fresh = find_resume("auto" if resume_from == "last" else resume_from, identity, out / "multirun" / "x" / "new",
                        out, multirun=True)
    assert fresh.finished is None and fresh.checkpoint is None


def sweep_config(outputs: Path, task: list[str], folder: str = "${paths.outputs}/multirun/${ccexp.sweep_id:}"):
    import ccexp.config  # noqa: F401  (registers ccexp.sweep_id)

    return OmegaConf.create({"paths": {"outputs": str(outputs)},
                             "hydra": {"sweep": {"dir": folder}, "overrides": {"task": task, "hydra": []}}})


def test_the_same_sweep_command_finds_its_earlier_folder_and_another_command_does_not(tmp_path):
    from ccexp.launch.sweep import same_command_sweep, sweep_command, update_sweep_record

    task = ["seed=0,1", "sampler=random,uniform", f"paths.outputs={tmp_path}"]
    cfg = sweep_config(tmp_path, task)
    assert same_command_sweep(cfg) is None
    old, new = tmp_path / "multirun" / "2026-12-06" / "10-00-00-1", tmp_path / "multirun" / "2026-12-07" / "09-00-00-2"
    update_sweep_record(old, command=sweep_command(cfg), launched=1.0, pid=1, host="elsewhere")
    update_sweep_record(new, command=sweep_command(cfg), launched=2.0, pid=1, host="elsewhere")
    other = tmp_path / "multirun" / "2026-12-07" / "11-00-00-3"
    update_sweep_record(other, command=sorted(["seed=0,1,2", "sampler=random,uniform"]), launched=3.0)
    # the order the overrides were given in does not make another sweep; the newest launch of the command is it
    assert same_command_sweep(sweep_config(tmp_path, list(reversed(task)))) == "2026-12-07/09-00-00-2"
    assert same_command_sweep(sweep_config(tmp_path, ["seed=0,1"])) is None
    # a folder the user names is the user's: nothing is looked up
    assert same_command_sweep(sweep_config(tmp_path, task, folder=str(tmp_path / "mine"))) is None
    # the record keeps what the MLflow parent wrote beside the command
    update_sweep_record(new, parent_run_id="abc")
    assert json.loads((new / "sweep.json").read_text())["command"] == sweep_command(cfg)


def test_the_same_sweep_command_while_that_sweep_runs_is_one_line(tmp_path):
    import socket

    from ccexp.errors import CcexpError
    from ccexp.launch.sweep import same_command_sweep, sweep_command, update_sweep_record

    cfg = sweep_config(tmp_path, ["seed=0,1"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        update_sweep_record(tmp_path / "multirun" / "d" / "t", command=sweep_command(cfg), launched=time.time(),
                            pid=alive.pid, host=socket.gethostname())  # (a process started after launched is not it)
        with pytest.raises(CcexpError, match=rf"the same sweep is running now \(pid {alive.pid}, .*Ctrl-C"):
            same_command_sweep(cfg)
    finally:
        alive.kill()
        alive.wait()
    assert same_command_sweep(cfg) == "d/t"  # its process gone: the sweep is continued


def test_the_commands_a_report_prints_keep_the_sweeps_launcher_c44(tmp_path):
    """c44's kind: a command the report prints for a sweep (more seeds; the cheapest design) runs it under the
    launcher and settings it was launched with, and not in another folder or mode."""
    import yaml
    from mlflow import MlflowClient

    from ccexp.compare.report import sweep_context
    from ccexp.compare.verdict import extend_command

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {
        "hydra": ["hydra/launcher=packed", "hydra.launcher.runs_per_device=3", "hydra.mode=MULTIRUN",
                  f"hydra.sweep.dir={sweep}"],
        "task": ["sampler=random,uniform", "seed=0,1", "train.steps=4"]}}}))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.create_run(client.create_experiment("ccexp"), tags={"sweep_dir": str(sweep)}).info.run_id
    context = sweep_context(client, parent)
    command = extend_command(context["sweep_dir"], context["task_overrides"], ["0", "1"], 5)
    assert "hydra/launcher=packed hydra.launcher.runs_per_device=3 " in command
    assert "hydra.mode" not in command and command.count("hydra.sweep.dir=") == 1 and "seed=0,1,2,3,4" in command


def test_how_many_cores_a_run_had_does_not_split_a_comparison_c44(tmp_path):
    """c44's other side: runs of a packed sweep (trainer.threads=1, written by the launcher) and of a plain one
    (None) are one configuration; a setting of the experiment still splits it."""
    from mlflow import MlflowClient

    from ccexp.compare.report import one_configuration

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("ccexp")
    for i, (threads, lr) in enumerate([("1", "0.001"), ("1", "0.001"), ("None", "0.001"), ("None", "0.002")]):
        r = client.create_run(exp, run_name=f"random-s{i}", tags={"sampler": "random"}).info.run_id
        for k, v in {"sampler.name": "random", "seed": str(i), "trainer.threads": threads, "train.lr": lr}.items():
            client.log_param(r, k, v)
        client.set_terminated(r)
        time.sleep(0.01)
    runs = client.search_runs([exp])
    mine, notes = one_configuration([r for r in runs if r.data.params["train.lr"] == "0.001"], "sampler")
    assert len(mine) == 3 and notes == []
    mine, notes = one_configuration(runs, "sampler")
    assert len(mine) == 1 and "train.lr=0.001 where the newest run has 0.002" in notes[0]


@pytest.mark.slow
def test_a_packed_sweep_stopped_by_sigint_continues_with_the_same_command_c43(tmp_path):
    """The issue's story: a packed sweep of 4 jobs (2 at once) gets SIGINT while two train. Exit 130; each job that
    trained stopped at its step's end with its checkpoint (run.json stopped, MLflow KILLED); the stop line names each
    job's state and the command that continues it; nothing is left RUNNING. The same command again continues the
    checkpoints in the same MLflow runs, and the sweep ends with one parent and four finished children, reported on
    both seeds."""
    from mlflow import MlflowClient

    out = tmp_path / "out"
    args = ["-m", "hydra/launcher=packed", "hydra.launcher.runs_per_device=2", "sampler=random,uniform", "seed=0,1",
            "train.steps=200", "train.log_every_n_steps=1", *SMALL, f"data.path={CASES / 'round5-150.jsonl'}",
            f"paths.outputs={out}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    text, sweep = interrupted_sweep(args, out, tmp_path / "first.log")
    stopped = [json.loads(p.read_text()) for p in sweep.glob("*/run.json")]
    assert len(stopped) == 2 and all(m["status"] == "stopped" for m in stopped), stopped
    assert all((d / "checkpoints" / "last.ckpt").is_file() for d in sweep.glob("*-s*-*") if (d / "run.json").is_file())
    assert "sweep: stopped by SIGINT: 0 of 4 job(s) finished" in text
    assert len(re.findall(r"#\w+-s\d-\w+ \(.*\): stopped at step \d+ of 200; continues from .*last\.ckpt", text)) == 2
    continue_line = re.search(r"to continue it \(finished jobs kept, stopped ones from their checkpoints\): "
                              r"python -m ccexp (.*)", text)
    assert continue_line and f"hydra.sweep.dir={sweep}" in continue_line.group(1)
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp").experiment_id
    assert sorted(r.info.status for r in client.search_runs([exp])) == ["KILLED"] * 3  # two jobs and the parent

    again = python_m("ccexp", *args, cwd=ROOT, env=env, timeout=600)
    text = again.stdout + again.stderr
    assert again.returncode == 0, text[-3000:]
    assert f"sweep: continuing {sweep}, launched before with the same command" in text
    assert len(re.findall(r"resume: continuing after step \d+ from .*last\.ckpt", text)) == 2
    runs = client.search_runs([exp])
    parents = [r for r in runs if r.data.tags.get("ccexp.sweep") == "true"]
    children = [r for r in runs if r not in parents]
    assert len(parents) == 1 and len(children) == 4 and {r.info.status for r in runs} == {"FINISHED"}
    assert {r.data.tags.get("mlflow.parentRunId") for r in children} == {parents[0].info.run_id}
    assert sorted(r.data.params["seed"] for r in children) == ["0", "0", "1", "1"]
    assert "sweep: 4 of 4 job(s) finished" in text and "(2 paired seed(s))" in text


def test_jobs_that_differ_only_in_their_seed_share_one_composition_and_get_what_composing_gives(tmp_path):
    """A sweep plans thousands of seeds in seconds by composing each configuration once; a job's config made so is
    the one Hydra composes with its seed (every setting that follows ${seed} follows it), and nothing else is shared."""
    from ccexp.config import compose
    from ccexp.launch.arms import job_config

    composed: dict = {}
    args = [*SMALL, "sampler=clusterclip", f"paths.outputs={tmp_path}"]
    first = job_config(composed, [*args, "seed=0"], lambda config_name, overrides: compose(overrides))
    seven = job_config(composed, [*args, "seed=7"], lambda config_name, overrides: compose(overrides))
    assert len(composed) == 1 and first.seed == 0  # the copy did not change the composition it was made from
    assert OmegaConf.to_container(seven, resolve=True) == OmegaConf.to_container(compose([*args, "seed=7"]),
                                                                                 resolve=True)
    other = job_config(composed, [*args, "seed=7", "train.lr=0.01"], lambda config_name, overrides: compose(overrides))
    assert len(composed) == 2 and other.train.lr == 0.01


def test_the_sweeper_checks_one_composition_per_configuration_and_still_refuses_a_bad_seed():
    """Hydra's basic sweeper composes every job of a batch before the first starts (about 0.13 s each on 2 cores:
    26 s of a 200-job sweep's start); ccexp's composes one of the jobs that differ only in seed=<int>, with Hydra's
    own config loader, and a job whose seed is not an integer still gets Hydra's error before any job runs."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.errors import ConfigCompositionException
    from hydra.types import RunMode

    from ccexp.config import register
    from hydra_plugins.ccexp_launcher.ccexp_launcher import BasicSweeper

    register()
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ccexp.conf"))
    master = loader.load_configuration("config", overrides=["debug=tiny"], run_mode=RunMode.MULTIRUN)
    assert master.hydra.sweeper._target_.endswith("ccexp_launcher.BasicSweeper")  # hydra/sweeper=basic is ccexp's
    sweeper = BasicSweeper(max_batch_size=None, params=None)
    sweeper.config, sweeper.config_loader, sweeper.hydra_context = master, loader, None
    composed = []
    real = loader.load_sweep_config
    loader.load_sweep_config = lambda master_config, sweep_overrides: composed.append(sweep_overrides) or real(
        master_config, sweep_overrides)
    sweeper.validate_batch_is_legal([[f"seed={s}", f"sampler={n}"] for n in ("random", "uniform") for s in range(50)])
    assert composed == [["seed=0", "sampler=random"], ["seed=0", "sampler=uniform"]]
    with pytest.raises(ConfigCompositionException, match="seed=x1"):
        sweeper.validate_batch_is_legal([["seed=0", "sampler=random"], ["seed=x1", "sampler=random"]])
    with pytest.raises(ConfigCompositionException):
        sweeper.validate_batch_is_legal([["seed=0", "sampler=random"], ["seed=1", "sampler=nosuch"]])


def test_hydra_launcher_joblib_is_ccexps_own_whose_jobs_stop_as_a_single_run():
    """c43's kind at its other place: ``hydra/launcher=joblib`` (hydra's plugin, documented) ran its jobs in worker
    processes that a Ctrl-C killed mid-step; ccexp's launcher of that name keeps the plugin's settings and stops them
    as packed does."""
    from hydra import compose, initialize_config_dir

    from ccexp.__main__ import CONFIG_DIR
    from ccexp.launch.packing import PackedTask, StoppingTask
    from hydra_plugins.ccexp_launcher.ccexp_launcher import JoblibLauncher, PackedLauncher

    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("config", overrides=["hydra/launcher=joblib", "hydra.launcher.n_jobs=3"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_ == "hydra_plugins.ccexp_launcher.ccexp_launcher.JoblibLauncher"
    assert cfg.hydra.launcher.n_jobs == 3 and cfg.hydra.launcher.prefer == "processes"
    assert issubclass(PackedLauncher, JoblibLauncher) and issubclass(PackedTask, StoppingTask)
    # the name is taken from the plugin's schema on purpose: Hydra's deprecation note about it is not shown to users
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    shown = python_m("ccexp", "hydra/launcher=joblib", "--cfg", "hydra", cwd=ROOT, env=env, timeout=120)
    assert shown.returncode == 0 and "JoblibLauncher" in shown.stdout and "validated against" not in shown.stderr


@pytest.mark.slow
def test_a_joblib_sweep_stopped_by_sigint_leaves_each_training_job_stopped_with_its_checkpoint(tmp_path):
    """hydra/launcher=joblib, two jobs at once, SIGINT while both train: exit 130, both stopped at a step's end
    with a checkpoint, their MLflow runs KILLED, and the stop lines name them and the command that continues."""
    from mlflow import MlflowClient

    out = tmp_path / "out"
    args = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "sampler=random", "seed=0,1",
            "train.steps=300", "train.log_every_n_steps=1", *SMALL, f"data.path={CASES / 'round5-150.jsonl'}",
            f"paths.outputs={out}"]
    text, sweep = interrupted_sweep(args, out, tmp_path / "sweep.log")
    assert [json.loads(p.read_text())["status"] for p in sweep.glob("*/run.json")] == ["stopped", "stopped"]
    assert len(list(sweep.glob("*/checkpoints/last.ckpt"))) == 2
    assert "sweep: stopped by SIGINT: 0 of 2 job(s) finished, 2 stopped" in text and "to continue it" in text
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp").experiment_id
    assert sorted(r.info.status for r in client.search_runs([exp])) == ["KILLED"] * 3
