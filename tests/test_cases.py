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

from warm import python_m, python_popen
from conftest import ROOT, run_ccexp

CASES = Path(__file__).parent / "cases"
# the cases' TINY: debug=tiny's sizes (20 steps of 8 rows of 64 tokens, one micro-batch of 8) on the cases' jsonl files
TINY = ["debug=tiny", "data=jsonl", "data.label_fields=[domain]", "train.max_doc_tokens=64", "eval.max_tokens=63"]


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
    assert report.startswith("# ccexp comparison: 1 run of sweep ")


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
    assert "longer than embedder.max_seq_length=128 tokens" in proc.stdout + proc.stderr
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
    proc = python_popen("ccexp", *args, cwd=tmp_path, env={**os.environ})
    _wait_for(out, "runs/*/*/checkpoints/step-10.ckpt", proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    line = one_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", err), code)
    assert signal.Signals(signum).name in line and "run the same command again to continue" in line
    client, rs = runs(out)
    assert rs[0].info.status == "KILLED"
    stopped = int(line.split("after step ")[1].split(";")[0])
    assert 10 <= stopped < 40
    resumed = run_ccexp(*args, cwd=tmp_path)  # the same command continues the stopped run (docs/using.md)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = np.load(sorted(out.glob("runs/*/*/batches/rank0.npz"))[-1])["steps"]
    assert steps[0] == stopped and steps[-1] == 39  # it went on from the step the signal stopped
    _, rs = runs(out)  # the interrupted MLflow run is continued, not a second one of the same name opened
    assert len(rs) == 1 and rs[0].info.status == "FINISHED" and rs[0].data.tags["resumed"] == "1"
    assert "resumed_with" not in rs[0].data.tags  # no setting differs from the stopped run's
    assert "continued from where it was interrupted" in resumed.stdout + resumed.stderr  # the "mlflow: run" line
    assert "You're resuming from a checkpoint" not in resumed.stderr + resumed.stdout


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
    line = one_line(ccexp(tmp_path, "tiny.jsonl", "train.micro_batch_size=4", f"train.resume_from={ckpt}"), 2)
    assert "train.micro_batch_size 8 -> 4" in line and "grad_accumulation" not in line  # what the user set


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


# -- round 3 -------------------------------------------------------------------------------------------
def test_c12_repeated_ids_are_named_and_the_split_keeps_its_fraction(tmp_path):
    # (the plain hash split: data.heldout_stratify=auto would add documents of the domains it held out none of)
    proc = ccexp(tmp_path, "dup-ids.jsonl", "train.steps=2", "logger=none", "data.heldout_stratify=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "corpus: 1 id(s) repeat, in 150 rows: '59' (150 rows)" in log and "data.id_field=null" in log
    held = int(log.split(" held out) in ")[0].rsplit("(", 1)[1].replace(",", ""))
    assert held < 30  # 300 documents at 5 %: about 15, not the 156 of a split decided once for 150 rows
    from ccexp.data.store import open_corpus

    corpus = open_corpus(next((tmp_path / "out" / "cache" / "corpus").glob("*[!.]*")))
    ids = list(corpus.ids)
    repeats = corpus.heldout[[i for i, x in enumerate(ids) if x == "59"]]
    assert 0 < repeats.sum() < repeats.size  # the 150 rows of id 59 fall on both sides
    from ccexp.data.corpus import stratify_heldout  # noqa: F401  (the same split function family)

    # ids are compared as text: an int 0 and a string "0" are one id, said in the same line
    rows = [{"id": 0, "text": "zero as an int", "domain": "a"}, {"id": "0", "text": "zero as text", "domain": "a"}]
    rows += [{"id": f"d{i}", "text": f"document number {i}", "domain": "b"} for i in range(40)]
    path = tmp_path / "int-and-str.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_ccexp(*TINY, f"data.path={path}", f"paths.outputs={tmp_path / 'out2'}", "train.steps=1", "logger=none",
                     "clusterer.k=2", "data.heldout_fraction=0.2", "data.heldout_stratify=null", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'0' (2 rows)" in proc.stdout + proc.stderr and 'an int 0 and a string "0" are one id' in proc.stdout + proc.stderr


def _state(ckpt: Path) -> dict:
    import torch

    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def test_c13_a_requeued_sweep_job_continues_from_its_own_checkpoint_as_if_never_stopped(tmp_path):
    """The README's Slurm requeue recipe: the sweep is stopped by SIGTERM after a checkpoint and the same
    command runs again (the same sweep folder, as submitit requeues): the job resumes from its own
    last.ckpt, and its final weights and held-out scores equal an uninterrupted run's."""
    args = ["-m", *TINY, f"data.path={CASES / 'tiny.jsonl'}", "sampler=random", "train.steps=12",
            "train.checkpoint_every_n_steps=5", "train.resume_from=auto", "logger=none", "train.log_every_n_steps=1"]
    whole = run_ccexp(*args, f"paths.outputs={tmp_path / 'whole'}", cwd=tmp_path, )
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "out"
    env = {**os.environ, "CCEXP_SWEEP_ID": "2026-12-01/requeued", "PYTHONWARNINGS": "ignore"}
    proc = python_popen("ccexp", *args, f"paths.outputs={out}", cwd=tmp_path, env=env)
    _wait_for(out, "multirun/*/*/*/checkpoints/step-5.ckpt", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    again = python_m("ccexp", *args, f"paths.outputs={out}", cwd=tmp_path, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr
    assert "resume: train.resume_from=auto is" in log and "starting fresh" not in log
    assert "on exactly the tokens an uninterrupted run trains on" in log
    assert "You're resuming from a checkpoint that ended before the epoch ended" not in log  # ours is exact
    (job,) = [p.parent for p in out.glob("multirun/*/*/*/checkpoints")]
    (ref,) = [p.parent for p in (tmp_path / "whole").glob("multirun/*/*/*/checkpoints")]
    import torch

    for folder in (job, ref):  # each run's last.ckpt is its final state (step 12), not its last periodic save (10)
        last = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert last["global_step"] == 12
    a, b = _state(job / "checkpoints" / "last.ckpt"), _state(ref / "checkpoints" / "last.ckpt")
    assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    assert (job / "tables" / "heldout_documents.csv").read_text() == (ref / "tables" / "heldout_documents.csv").read_text()


def test_c14_a_second_ctrl_c_stops_at_once_with_status_130_one_line_and_a_killed_run(tmp_path):
    out = tmp_path / "out"
    args = [*TINY, f"data.path={CASES / 'tiny.jsonl'}", f"paths.outputs={out}", "train.steps=40", "sampler=random",
            "train.log_every_n_steps=5", "trainer.enable_progress_bar=false"]
    log = tmp_path / "run.log"
    proc = python_popen("ccexp", *args, cwd=tmp_path, env={**os.environ}, stdout=log, merge=True)
    deadline = time.time() + 600
    while "train: step 5/" not in log.read_text():  # wait for the fifth step
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, text[-3000:]
    stops = [ln for ln in text.splitlines() if ln.startswith("ccexp: ")]
    assert len(stops) == 1 and "SIGINT" in stops[0] and "Traceback" not in text
    _, rs = runs(out)
    assert rs[0].info.status == "KILLED"


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_c15_a_half_created_mlflow_store_is_set_aside_and_created_anew(tmp_path):
    import shutil

    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(CASES / "half-created-mlflow.db", out / "mlflow.db")
    proc = ccexp(tmp_path, "tiny.jsonl", "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was left half-created" in proc.stdout + proc.stderr and "held no run" in proc.stdout + proc.stderr
    assert len(list(out.glob("mlflow.db.half-created-*"))) == 1
    _, rs = runs(out)
    assert [r.info.status for r in rs] == ["FINISHED"]


@pytest.mark.parametrize("size,where", [("1m", "the MLflow store in"), ("3m", "checkpoints")])
def test_c15_a_full_disk_is_one_line_naming_the_folder_and_leaves_nothing_half_written(tmp_path, size, where):
    out = tmp_path / "out"
    if not _tmpfs(out, size):
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        proc = ccexp(tmp_path, "tiny.jsonl", "train.steps=2")
        line = one_line(proc, 2)
        assert line.startswith("ccexp: error: no space left on the disk holding") and where in line and str(out) in line
        assert not (out / "mlflow.db").exists() or where != "the MLflow store in"  # never left half-created
        left = [p for p in out.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".tmp-")]
        assert not left and not list(out.rglob("*.ckpt"))  # no checkpoint or stage folder cut short
        for stage in (p for p in out.glob("cache/[!.]*/[!.]*") if p.is_dir()):  # every published stage is whole
            assert (stage / "DONE").is_file(), stage
    finally:
        subprocess.run(["umount", str(out)], capture_output=True)


def test_c16_a_plan_with_more_clusters_than_documents_is_one_line(tmp_path):
    proc = python_m("ccexp.plan", "plan.source=synthetic", "plan.clusters=100", "plan.documents=10", "train.steps=10",
                    "logger=none", f"paths.outputs={tmp_path}", cwd=tmp_path, timeout=300)
    line = one_line(proc, 2)
    assert "plan.clusters=100 is more than plan.documents=10" in line
    # the same kind for a real corpus: before any embedding
    line = one_line(ccexp(tmp_path, "tiny.jsonl", "clusterer.k=1000"), 2)
    assert "clusterer.k asks for 1000 clusters but the corpus has" in line
    assert not list((tmp_path / "out" / "cache").glob("embed/*"))
