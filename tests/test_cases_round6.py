"""Round 6 of the team's ``shared/cases`` (c45-c52, "never lose a run, round 6"), each the kind of fault it stands
for, asserting the right behaviour. The corpora are the cases' own, copied to ``tests/cases/``: ``round5-120.jsonl``
(c45, c46) and ``tiny.jsonl`` (c47-c52)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ccexp.launch.resume import read_run_json
from conftest import run_ccexp
from warm import python_popen
from test_cases import CASES

# the cases' own small run: rows of 64 tokens, 512 tokens a step, no logger unless a case needs one
SMALL = ["data=jsonl", "data.label_fields=[domain]", "train.tokens_per_step=512", "train.micro_batch_size=8",
         "train.seq_len=64", "eval.max_tokens=63", "model.n_positions=64", "model.tokenizer.vocab_size=512",
         "trainer.enable_progress_bar=false"]


def small(tmp_path: Path, corpus: str, *args: str) -> list[str]:
    return [*SMALL, f"data.path={CASES / corpus}", f"paths.outputs={tmp_path / 'out'}",
            f"paths.cache={tmp_path / 'cache'}", *args]


# -- c45: a run.json field of the wrong type is named in a warning and left out; the rest of the record counts ------
@pytest.mark.parametrize("field,value,said", [
    ("metrics", "bad", "metrics is a string, not an object"),
    ("metrics", {"ppl": "x"}, "metrics['ppl'] is a string, not a number"),
    ("fingerprints", "0cfe1dd50d673c42", "fingerprints is a string, not an object"),
    ("pid", "123", "pid is a string, not an integer"),
    ("step", [1], "step is a list, not an integer")])
def test_c45_a_run_json_field_of_the_wrong_type_is_named_and_left_out(tmp_path, field, value, said):
    args = small(tmp_path, "round5-120.jsonl", "clusterer.k=2", "train.steps=2", "logger=none")
    first = run_ccexp(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (path,) = (tmp_path / "out").glob("runs/*/*/run.json")
    meta = json.loads(path.read_text())
    meta[field] = value
    path.write_text(json.dumps(meta))
    assert field not in read_run_json(path) and read_run_json(path)["status"] == "finished"
    again = run_ccexp(*args, cwd=tmp_path)
    log = again.stdout + again.stderr
    assert again.returncode == 0 and "Traceback" not in log, log[-3000:]
    assert f"resume: {path}: {said}; that field is left out" in log  # the file and the field, in one warning
    assert "finished (" in log and "nothing to do" in log and "train: step" not in log  # the run still counts


def test_c45_a_run_json_nested_too_deeply_or_of_odd_pids_is_read_without_a_traceback(tmp_path):
    import os

    from ccexp.artifacts import pid_alive

    path = tmp_path / "run.json"
    path.write_text('{"status": "finished", "metrics": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ValueError, match="nested too deeply"):
        read_run_json(path)
    for pid in (0, -1, -os.getpid(), 2**40, True):  # no process: not the run (a negative pid is a process group)
        assert not pid_alive(pid), pid


# -- c46: a recorded pid is the run only when its process started before the record ---------------------------------
def test_c46_a_pid_now_of_another_program_is_not_the_run_which_continues_from_its_checkpoint(tmp_path):
    import os
    import signal
    import subprocess
    import time

    from ccexp.artifacts import pid_alive, process_created

    args = small(tmp_path, "round5-120.jsonl", "clusterer.k=2", "sampler=random", "train.steps=40",
                 "train.checkpoint_every_n_steps=2", "logger=none")
    run = python_popen("ccexp", *args, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    deadline = time.time() + 300
    while not list((tmp_path / "out").glob("runs/*/*/checkpoints/step-4.ckpt")):
        assert run.poll() is None and time.time() < deadline, "no step-4.ckpt"
        time.sleep(0.2)
    run.send_signal(signal.SIGKILL)  # run.json still says running, with this pid
    run.wait()
    (path,) = (tmp_path / "out").glob("runs/*/*/run.json")
    with subprocess.Popen(["sleep", "300"]) as other:  # another program, started after the run: given its pid
        meta = json.loads(path.read_text())
        assert meta["status"] == "running" and meta["started"] < time.time()
        meta["pid"] = other.pid
        path.write_text(json.dumps(meta))
        assert pid_alive(other.pid) and not pid_alive(other.pid, created=meta["pid_created"])
        same = run_ccexp(*args, cwd=tmp_path)
        other.kill()
    log = same.stdout + same.stderr
    assert same.returncode == 0 and "is running now" not in log, log[-3000:]
    assert "was killed (its process is gone; run.json still said running)" in log
    said = [ln for ln in log.splitlines() if "continuing it from" in ln]  # continued from its checkpoint, in a line
    assert len(said) == 1 and "/checkpoints/" in said[0], log[-3000:]
    assert read_run_json(path)["status"] in ("killed", "finished")
    assert pid_alive(os.getpid(), created=process_created()) and pid_alive(os.getpid(), started_by=time.time())


# -- c47: a setting that changes nothing a run computes is not part of its identity ----------------------------------
def test_c47_a_finished_run_is_not_trained_again_for_a_setting_that_changes_nothing_it_computes(tmp_path):
    import shutil

    from ccexp.config import compose
    from ccexp.names import run_identity

    shutil.copy(CASES / "tiny.jsonl", tmp_path / "tiny.jsonl")
    args = [*small(tmp_path, "tiny.jsonl", "clusterer.k=4", "sampler=random", "train.steps=6", "logger=none"),
            f"data.path={tmp_path / 'tiny.jsonl'}"]  # the copy, by its absolute path (the second names it relatively)
    first = run_ccexp(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    shown = [a for a in args if not a.startswith(("data.path=", "trainer.enable_progress_bar=", "logger="))]
    second = run_ccexp(*shown, "data.path=tiny.jsonl", "trainer.enable_progress_bar=true", "report.min_effect=0.05",
                       "train.log_every_n_steps=2", "train.checkpoint_every_n_steps=3", "logger=mlflow", cwd=tmp_path)
    log = second.stdout + second.stderr
    assert second.returncode == 0 and "finished (step 6 of 6" in log and "nothing to do" in log, log[-3000:]
    assert "train: step" not in log and len(list((tmp_path / "out").glob("runs/*/*/run.json"))) == 1
    # what a run computes still makes another configuration: the sampler's seed, the corpus file, the budget
    base = run_identity(compose(args)).digest
    for other in ("sampler.seed=1", "train.steps=7", f"data.path={CASES / 'round4.jsonl'}", "eval.max_tokens=62"):
        assert run_identity(compose([*args, other])).digest != base, other


# -- c48: runs trained on other stage outputs (a corpus rewritten in place) are not paired ---------------------------
def test_c48_the_report_does_not_pair_runs_of_the_same_settings_on_a_corpus_rewritten_in_place(tmp_path):
    from warm import python_m

    corpus = tmp_path / "corpus.jsonl"
    lines = (CASES / "tiny.jsonl").read_text().splitlines(keepends=True)
    corpus.write_text("".join(lines))
    args = [*small(tmp_path, "tiny.jsonl", "clusterer.k=4", "train.steps=2"), f"data.path={corpus}"]
    first = run_ccexp(*args, "sampler=random", cwd=tmp_path)
    corpus.write_text("".join(lines[:200]))  # the same path and settings, 100 of its 300 documents gone
    second = run_ccexp(*args, "sampler=uniform", cwd=tmp_path)
    assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-3000:]
    report = python_m("ccexp.report", "--store", str(tmp_path / "out" / "mlflow.db"), "--all-runs", "--out",
                      str(tmp_path / "report"), cwd=tmp_path, timeout=300)
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr[-3000:]
    text = (tmp_path / "report" / "report.md").read_text()
    assert "corpus fingerprint=" in text and "left out" in text  # the corpus difference, named
    assert "1 pair" not in text and not (tmp_path / "report" / "paired.csv").exists()  # nothing paired across corpora


# -- c49: lm-eval scores the weights the headline metrics are of (the average under eval.average=tail|ema) ----------
def test_c49_lm_eval_scores_the_averaged_weights_the_headline_is_of(tmp_path):
    from mlflow import MlflowClient

    proc = run_ccexp("-m", *small(tmp_path, "tiny.jsonl", "clusterer.k=4", "sampler=random", "train.steps=6"),
                     "eval=lm_eval", "eval.lm_eval.max_docs_per_task=6", "eval.lm_eval.mc_docs=6",
                     "eval.average=none,tail", "eval.average_span=1.0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lm-eval: scoring the tail-averaged weights, as the headline held-out metrics" in proc.stdout + proc.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    runs = {r.data.params["eval.average"]: r.data.metrics
            for r in client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])
            if r.data.tags.get("ccexp.sweep") != "true"}
    none, tail = runs["none"], runs["tail"]
    assert tail["eval/final/ppl"] == pytest.approx(none["eval/ppl"])  # the same final weights...
    lm = [k for k in tail if k.startswith("lm_eval/") and k.endswith("word_perplexity")]
    assert lm and all(tail[k] != none[k] for k in lm)  # ...but lm-eval scored the tail run's averaged ones


# -- c50: a file system without locks is said once and does not stop a run --------------------------------------------
def test_c50_a_file_system_without_locks_is_warned_of_and_every_command_runs(tmp_path):
    from ccexp.artifacts import NO_LOCKS, file_lock

    nfs = tmp_path / "nfs"
    nfs.mkdir()
    env = {"PYTHONPATH": str(CASES / "nolock"), "NOLOCK_DIR": str(nfs)}  # flock fails with ENOLCK under nfs/
    common = [*SMALL, f"data.path={CASES / 'tiny.jsonl'}", "clusterer.k=4", "sampler=random", "train.steps=4",
              "logger=none"]
    for outputs, cache in ((nfs / "out", tmp_path / "cache"), (nfs / "out2", nfs / "cache")):
        proc = run_ccexp(*common, f"paths.outputs={outputs}", f"paths.cache={cache}", cwd=tmp_path, env=env)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "Traceback" not in log and "is running now" not in log, log[-3000:]
        assert "gives no file locks (ENOLCK" in log and "train: step 4/4" in log
    # the same lock elsewhere is taken, and an error that is not "no locks" is not swallowed
    with file_lock(tmp_path / "x.lock", "nothing"):
        assert (tmp_path / "x.lock").exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OSError) as raised:  # under a file: not a missing lock support, so not swallowed
        with file_lock(tmp_path / "a-file" / "x.lock", "nothing"):
            pass
    assert raised.value.errno not in NO_LOCKS


# -- c51: a full disk is named by the folder that filled (a logger's save_dir), not always paths.outputs -------------
def test_c51_a_full_logger_folder_is_one_line_naming_it_and_its_setting(tmp_path):
    import subprocess

    from test_cases import _tmpfs

    tb = tmp_path / "tb"
    if not _tmpfs(tb, "256k"):
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        (tb / "filler").write_bytes(b"\0" * (244 * 1024))  # 12 KiB left: the pre-flight's probe passes, the run fills it
        proc = run_ccexp(*small(tmp_path, "tiny.jsonl", "clusterer.k=4", "sampler=random", "train.steps=20"),
                         "logger=tensorboard", f"logger.loggers.tensorboard.save_dir={tb}", cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(tb)], capture_output=True)
    log = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ccexp: error:")]
    assert proc.returncode == 2 and "Traceback" not in log and len(lines) == 1, log[-3000:]
    assert f"no space left on the disk holding {tb}" in lines[0]
    assert "set logger.loggers.tensorboard.save_dir to a folder on a larger disk" in lines[0]


def test_a_full_disk_line_names_the_setting_whose_folder_holds_the_file(tmp_path):
    import errno

    from ccexp.errors import disk_full_line

    (tmp_path / "cache" / "embed").mkdir(parents=True)
    folders = {"paths.outputs": str(tmp_path / "out"), "paths.cache": str(tmp_path / "cache")}
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache" / "embed" / "x.npy"))
    assert f"disk holding {tmp_path / 'cache' / 'embed'}: free some space there, or set paths.cache to" in \
        disk_full_line(full, folders["paths.outputs"], folders)
    unnamed = OSError(errno.ENOSPC, "No space left on device")  # no file, no folder (almost) full: paths.outputs
    assert "set paths.outputs to" in disk_full_line(unnamed, folders["paths.outputs"], folders)
    assert disk_full_line(OSError(errno.EACCES, "Permission denied"), folders["paths.outputs"], folders) is None


# -- c52: a launch that trained no step records no throughput ----------------------------------------------------------
def test_c52_a_run_continued_after_its_last_step_records_no_throughput_of_an_empty_fit(tmp_path):
    import os
    import signal
    import time

    from mlflow import MlflowClient

    args = [*small(tmp_path, "tiny.jsonl", "clusterer.k=4", "sampler=random", "train.steps=6"), "eval=lm_eval",
            "eval.lm_eval.max_docs_per_task=10", "eval.lm_eval.mc_docs=10"]
    log = tmp_path / "first.log"
    first = python_popen("ccexp", *args, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=log,
                         merge=True)
    deadline = time.time() + 300
    while "lm-eval: task 1/" not in log.read_text():  # after the last step, during the evaluation
        assert first.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) == 143
    again = run_ccexp(*args, cwd=tmp_path)
    text = again.stdout + again.stderr
    assert again.returncode == 0 and "no step left to train in this launch" in text, text[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["train/tokens"] == 6 * 512
    assert "train/tokens_per_s" not in run.data.metrics and "time/train_seconds" not in run.data.metrics


def test_c47_paths_are_one_setting_however_written_and_a_word_is_not_a_path(tmp_path, monkeypatch):
    from ccexp.names import _absolute_paths

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "tiny.jsonl").write_text("{}\n")
    (tmp_path / "random").write_text("")  # a file named like a sampler: the setting stays a word
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "d" / "tiny.jsonl")
    same = str(tmp_path / "d" / "tiny.jsonl")
    for written in ("d/tiny.jsonl", "./d/tiny.jsonl", f"{tmp_path}/d/../d/tiny.jsonl", f"/{tmp_path}//d/tiny.jsonl",
                    "link.jsonl"):
        assert _absolute_paths({"path": written}, tmp_path) == {"path": same}, written
    assert _absolute_paths({"name": "random", "missing": "nope/x.jsonl"}, tmp_path) == \
        {"name": "random", "missing": "nope/x.jsonl"}


def test_c51_a_short_write_of_numpy_on_a_full_disk_is_the_full_disk_line(tmp_path):
    import shutil

    from ccexp.errors import disk_full_line

    full = OSError("115200 requested and 42944 written")  # numpy's tofile: no errno
    free = shutil.disk_usage(tmp_path).free
    line = disk_full_line(full, str(tmp_path), {"paths.outputs": str(tmp_path)})
    assert (line is None) == (free >= (1 << 20))  # only when a disk the run writes to is (almost) full
