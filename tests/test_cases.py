"""The failing inputs of the team's ``shared/cases`` (copied to ``tests/cases/``), each the kind of fault it
stands for, now asserting the right behaviour: never lose a run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from conftest import ROOT, run_ccexp

CASES = Path(__file__).parent / "cases"
# the cases' TINY, in tokens: 8 rows of 64 tokens per step (one micro-batch of 8)
TINY = ["data=jsonl", "data.label_fields=[domain]", "clusterer.k=4", "train.steps=20", "train.tokens_per_step=512",
        "train.micro_batch_size=8", "train.seq_len=64", "train.max_doc_tokens=64", "eval.max_tokens=63",
        "model.n_positions=64", "model.tokenizer.vocab_size=512", "trainer.enable_progress_bar=false",
        "trainer.threads=1"]


def ccexp(tmp_path, case: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    flags = [a for a in args if a.startswith("-")]  # Hydra takes its flags before the overrides
    return run_ccexp(*flags, *TINY, f"data.path={CASES / case}", f"paths.outputs={tmp_path / 'out'}",
                     *[a for a in args if not a.startswith("-")], cwd=tmp_path, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ccexp:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def runs(out: Path, experiment: str = "ccexp"):
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]) if exp else [])


def test_c01_a_relaunching_strategy_in_a_sweep_is_refused_before_any_job(tmp_path):
    proc = ccexp(tmp_path, "tiny40.jsonl", "-m", "data.heldout_fraction=0.1", "sampler=clusterclip",
                 "sampler.clip_threshold=3", "train.steps=10", "eval.min_cluster_docs=1", "trainer.strategy=ddp",
                 "trainer.devices=2", "seed=1,2")
    line = one_line(proc, 2)
    assert "trainer.strategy=ddp" in line and "ddp_spawn" in line and "torchrun" in line
    assert not list((tmp_path / "out").glob("multirun/*/*/*/.hydra"))  # no job started
    assert not runs(tmp_path / "out")[1]  # and no MLflow parent run was left behind


def test_c02_one_bad_job_fails_alone_and_the_sweep_reports_what_finished(tmp_path):
    proc = ccexp(tmp_path, "tiny.jsonl", "-m", "sampler=clusterclip", "sampler.clip_threshold=0,5,-1")
    line = one_line(proc, 1)
    assert "2 sweep job(s) failed" in line and line.count("clip_threshold must be an integer >= 1") == 2
    jobs = sorted((tmp_path / "out").glob("multirun/*/*/*/status.json"))
    statuses = {next(o for o in s["overrides"] if o.startswith("sampler.clip_threshold=")): s["status"]
                for s in (json.loads(p.read_text()) for p in jobs)}
    assert statuses == {"sampler.clip_threshold=0": "FAILED", "sampler.clip_threshold=5": "FINISHED",
                        "sampler.clip_threshold=-1": "FAILED"}
    for p in jobs:  # each failed job has its line in its own log
        if json.loads(p.read_text())["status"] == "FAILED":
            assert "clip_threshold must be an integer >= 1" in (p.parent / "ccexp.log").read_text()
    client, rs = runs(tmp_path / "out")
    parent = [r for r in rs if r.data.tags.get("ccexp.sweep") == "true"]
    children = [r for r in rs if r.data.tags.get("ccexp.sweep") != "true"]
    assert len(parent) == 1 and parent[0].info.status == "FAILED"  # closed, not left RUNNING
    assert [r.info.status for r in children] == ["FINISHED"]
    report = next((tmp_path / "out").glob("multirun/*/*/report/report.md")).read_text()
    assert "1 runs" in report


@pytest.mark.slow
def test_c03_concurrent_runs_share_one_embedding_and_keep_their_own_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-m", "ccexp", *TINY, f"data.path={CASES / 'tiny.jsonl'}",
                               f"paths.outputs={out}", f"sampler={s}", "embedder.shard_size=50"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in ("random", "uniform", "clusterclip")]
    results = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    logs = "".join(out + err for out, err in results)
    stage_lines = [ln for ln in logs.splitlines() if "[ccexp][INFO] - embed: " in ln and "reused=" in ln]
    assert len(stage_lines) == 3 and sum("reused=False" in ln for ln in stage_lines) == 1  # embedded once
    assert len(list((out / "cache" / "embed").iterdir())) == 1
    run_dirs = sorted(out.glob("runs/*/*"))
    assert len(run_dirs) == 3 and all((d / "checkpoints" / "last.ckpt").is_file() for d in run_dirs)
    client, rs = runs(out)
    assert sorted(r.data.tags["sampler"] for r in rs) == ["clusterclip", "random", "uniform"]
    assert all(r.info.status == "FINISHED" for r in rs)


@pytest.mark.slow
def test_joblib_launcher_runs_three_jobs_at_once(tmp_path):
    proc = ccexp(tmp_path, "tiny.jsonl", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=3",
                 "sampler=random,uniform,clusterclip", "embedder.shard_size=50")
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, rs = runs(tmp_path / "out")
    children = [r for r in rs if r.data.tags.get("ccexp.sweep") != "true"]
    assert sorted(r.data.tags["sampler"] for r in children) == ["clusterclip", "random", "uniform"]
    assert all(r.info.status == "FINISHED" for r in rs)
    assert len(list((tmp_path / "out" / "cache" / "embed").iterdir())) == 1


def test_c04_long_documents_are_reported_and_can_be_embedded_whole(tmp_path):
    from ccexp.embedding.sentence import SentenceEmbedder

    recs = {json.loads(ln)["id"]: json.loads(ln)["text"] for ln in (CASES / "long-boilerplate.jsonl").open()}
    a, b = recs["A"], recs["B"]  # the same 600-word preamble, different topics after it
    truncated, n_long = SentenceEmbedder(device="cpu").encode([a, b])
    whole, n_chunked = SentenceEmbedder(device="cpu", long_documents="chunk_mean").encode([a, b])
    assert n_long == n_chunked == 2
    assert float(truncated[0] @ truncated[1]) > 0.999  # the model saw the preamble only
    assert float(whole[0] @ whole[1]) < 0.99 and np.allclose(np.linalg.norm(whole, axis=1), 1.0, atol=1e-5)
    proc = ccexp(tmp_path, "long-boilerplate.jsonl", "clusterer.k=3", "train.steps=10", "data.heldout_fraction=0.1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "longer than embedder.max_seq_length=256 tokens" in proc.stdout + proc.stderr
    _, rs = runs(tmp_path / "out")
    assert rs[0].data.metrics["embed/truncated_documents"] >= 2


def _wait_for(path_glob: Path, pattern: str, proc, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not list(path_glob.glob(pattern)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_c05_a_signal_stops_with_a_line_a_status_and_a_checkpoint_to_resume(tmp_path, signum, code):
    out = tmp_path / "out"
    args = [*TINY, f"data.path={CASES / 'tiny.jsonl'}", f"paths.outputs={out}", "train.steps=40",
            "train.checkpoint_every_n_steps=5", "train.record_batches=true"]
    proc = subprocess.Popen([sys.executable, "-m", "ccexp", *args], cwd=tmp_path, env={**os.environ},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out, "runs/*/*/checkpoints/step-10.ckpt", proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    line = one_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", err), code)
    assert signal.Signals(signum).name in line and "train.resume_from=" in line
    client, rs = runs(out)
    assert rs[0].info.status == "KILLED"
    stopped = int(line.split("after step ")[1].split(";")[0])
    assert 10 <= stopped < 40
    resumed = run_ccexp(*args, "train.resume_from=last", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = np.load(sorted(out.glob("runs/*/*/batches/rank0.npz"))[-1])["steps"]
    assert steps[0] == stopped and steps[-1] == 39  # it went on from the step the signal stopped


def test_c06_accumulate_grad_batches_is_refused_with_its_replacement(tmp_path):
    line = one_line(ccexp(tmp_path, "tiny.jsonl", "trainer.accumulate_grad_batches=2"), 2)
    assert "accumulate_grad_batches was retired" in line and "micro_batch_size" in line


def test_c07_label_values_of_any_shape_make_safe_distinct_metric_names(tmp_path):
    proc = ccexp(tmp_path, "url-labels.jsonl", "train.steps=10", "data.heldout_fraction=0.4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, rs = runs(tmp_path / "out")
    run = rs[0]
    assert run.info.status == "FINISHED"
    names = {k for k in run.data.metrics if k.startswith("eval/ppl_domain/")}
    values = {json.loads(ln)["domain"] for ln in (CASES / "url-labels.jsonl").open()}
    assert len(names) == len(values)  # one metric per value, none merged, none lost
    mapping = json.loads(Path(client.download_artifacts(run.info.run_id, "labels/domain.json", tmp_path)).read_text())
    assert set(mapping) == values and len(set(mapping.values())) == len(values)
    assert {f"eval/ppl_domain/{v}" for v in mapping.values()} == names


def test_c08_lm_eval_tasks_fit_the_models_context(tmp_path):
    proc = ccexp(tmp_path, "short-context.jsonl", "eval=lm_eval", "eval.min_cluster_docs=1", "train.steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, rs = runs(tmp_path / "out")
    m, tags = rs[0].data.metrics, rs[0].data.tags
    assert 0.0 <= m["lm_eval/ccexp_continuation/acc"] <= 1.0 and "eval/ppl" in m
    assert not [t for t in tags if t.startswith("eval_error/")]


def test_evaluation_failures_keep_the_other_parts_and_the_trained_model(tmp_path):
    """A failing evaluation part (here lm-eval, given a task it cannot build) is one line and a tag; the
    held-out perplexity and the checkpoint stay."""
    from ccexp.evaluation.heldout import isolated

    errors: dict[str, str] = {}

    def broken():
        raise RuntimeError("lm-eval blew up\nwith details")

    assert isolated("lm_eval", errors, tmp_path, broken) is None
    assert errors == {"lm_eval": "RuntimeError: lm-eval blew up"} and "Traceback" in (tmp_path / "eval_errors.log").read_text()
    line = one_line(ccexp(tmp_path, "tiny.jsonl", "eval=lm_eval", "eval.lm_eval.tasks=[arc_easy]"), 2)
    assert "arc_easy" in line and "offline" in line and not (tmp_path / "out" / "cache").exists()  # before any work


def test_c09_resuming_under_other_settings_names_what_differs(tmp_path):
    first = ccexp(tmp_path, "tiny.jsonl", "train.checkpoint_every_n_steps=10")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = next((tmp_path / "out").glob("runs/*/*/checkpoints/step-10.ckpt"))
    line = one_line(ccexp(tmp_path, "tiny.jsonl", "clusterer.k=3", f"train.resume_from={ckpt}"), 2)
    assert "was saved with other settings" in line and "clusters 4 -> 3" in line


def test_c10_divergence_stops_at_the_first_non_finite_loss_with_one_line(tmp_path):
    bad = ["train.steps=10", "train.lr=1e5", "trainer.gradient_clip_val=null", "train.warmup_steps=0", "logger=none"]
    line = one_line(ccexp(tmp_path, "tiny.jsonl", *bad), 2)
    assert "is not finite (NaN or inf) at step" in line and "train.on_nonfinite=skip_batch" in line
    skipped = ccexp(tmp_path, "tiny.jsonl", *bad, "train.on_nonfinite=skip_batch")
    assert "Traceback" not in skipped.stderr  # finishes and records NaN, or stops at a bad gradient: one line
    if skipped.returncode:
        assert "not finite" in one_line(skipped, 2)


def test_c11_a_budget_that_does_not_split_over_the_ranks_stops_before_any_stage(tmp_path):
    line = one_line(ccexp(tmp_path, "tiny.jsonl", "train.tokens_per_step=448", "train.micro_batch_size=1",
                          "trainer.strategy=ddp_spawn", "trainer.devices=2", "logger=none"), 2)
    assert "7 rows of 64 tokens" in line and not (tmp_path / "out" / "cache").exists()
