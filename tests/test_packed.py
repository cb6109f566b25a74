"""Issue 33 §3: hydra/launcher=packed runs several jobs at once, each with its share of the machine: on GPUs
``runs_per_device`` per visible GPU, job n on GPU n mod GPUs; without one, ``runs_per_device`` at once; the
cores split evenly (trainer.threads, written into each run's config). Tested on the CPU, end to end."""
from __future__ import annotations

import pytest

from ccexp.errors import CcexpError
from ccexp.launch.packing import Packing, PackedTask


def test_packing_shares_gpus_round_robin_and_splits_the_cores():
    eight = Packing(4, gpus=8, cores=64)
    assert (eight.jobs, eight.threads) == (32, 2)
    assert [eight.share(n)["devices"] for n in range(10)] == [[n % 8] for n in range(10)]
    cpu = Packing(2, gpus=0, cores=2)
    assert (cpu.jobs, cpu.threads, cpu.share(5)) == (2, 1, {"threads": 1})  # no device setting without a GPU
    assert Packing(8, gpus=1, cores=4).threads == 1  # never below one thread
    assert cpu.describe() == "packed: up to 2 job(s) at once on this machine (no GPU), trainer.threads=1 each"
    assert eight.describe() == "packed: up to 4 job(s) at once on each of 8 GPU(s) (32 at once in all), trainer.threads=2 each"
    for bad in (0, -1, 1.5, True, "two", None):
        with pytest.raises(CcexpError, match=r"runs_per_device=.*: give a whole number >= 1"):
            Packing(bad, gpus=1, cores=4)


def test_a_packed_job_runs_with_its_share_written_into_its_config(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra = SimpleNamespace(job=SimpleNamespace(num=5), sweep=SimpleNamespace(dir=str(tmp_path)),
                            runtime=SimpleNamespace(output_dir=str(tmp_path / "job")), overrides=SimpleNamespace(task=[]))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra))
    seen = []
    task = PackedTask(lambda cfg: seen.append(OmegaConf.to_container(cfg.trainer)), Packing(2, gpus=4, cores=16))
    task(OmegaConf.create({"trainer": {"accelerator": "gpu", "devices": 1, "threads": 8}}))
    task(OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": 1, "threads": 8}}))
    assert seen == [{"accelerator": "gpu", "devices": [1], "threads": 2},  # job 5 of 4 GPUs: GPU 1
                    {"accelerator": "cpu", "devices": 1, "threads": 2}]


@pytest.mark.slow  # four tiny runs, two at a time: about a minute
def test_packed_runs_two_jobs_at_once_on_a_cpu_each_with_one_thread(tmp_path):
    from test_cases import ccexp, runs

    proc = ccexp(tmp_path, "tiny.jsonl", "-m", "hydra/launcher=packed", "hydra.launcher.runs_per_device=2",
                 "sampler=random,uniform", "seed=0,1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    import os

    threads = max(1, (os.cpu_count() or 1) // 2)
    assert f"packed: up to 2 job(s) at once on this machine (no GPU), trainer.threads={threads} each" in log
    _, rs = runs(tmp_path / "out")
    jobs = sorted((r for r in rs if r.data.tags.get("ccexp.sweep") != "true"), key=lambda r: r.info.start_time)
    assert len(jobs) == 4 and all(r.info.status == "FINISHED" for r in jobs)
    assert {r.data.params["trainer.threads"] for r in jobs} == {str(threads)}  # each run records its share
    spans = [(r.info.start_time, r.info.end_time) for r in jobs]
    at_once = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert at_once == 2  # two jobs overlap, never three


def test_a_packed_job_whose_turn_comes_after_the_sweep_was_stopped_does_not_start(monkeypatch, tmp_path):
    """The worker's side of a packed sweep's stop: a job that starts after the sweep got its signal records KILLED
    "not started" and returns to the sweep; the worker is left ignoring SIGINT and SIGTERM between jobs, and its
    mark as a worker in a job is gone."""
    import json
    import signal
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from ccexp.launch.packing import SweepStop

    hydra = SimpleNamespace(job=SimpleNamespace(num=0), sweep=SimpleNamespace(dir=str(tmp_path)),
                            runtime=SimpleNamespace(output_dir=str(tmp_path / "job")),
                            overrides=SimpleNamespace(task=["seed=1"]))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra))
    (tmp_path / ".stopping").write_text("stopped by SIGINT")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ran = []
        result = PackedTask(ran.append, Packing(1, gpus=0, cores=2))(OmegaConf.create({"trainer": {"threads": None}}))
        assert ran == [] and result != result  # nan: nothing trained
        status = json.loads((tmp_path / "job" / "status.json").read_text())
        assert status == {"status": "KILLED", "message": "not started: the sweep was stopped by SIGINT",
                          "overrides": ["seed=1"]}
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and not list((tmp_path / ".workers").iterdir())
        assert SweepStop(tmp_path).requested() == "stopped by SIGINT"
    finally:
        for s, h in before.items():
            signal.signal(s, h)
