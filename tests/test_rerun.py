"""Issue 34, item 1: running the same command again. A configuration that finished does nothing (one line, no
new MLflow run); one that stopped continues from its checkpoint in its own MLflow run; ``train.resume_from=last``
takes only an unfinished run's checkpoint; ``fresh`` starts over; a run of the configuration still going on
this machine is refused. The decision table of ``ccexp.launch.resume.find_resume`` on run folders made here,
then the whole story through the CLI (slow)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from ccexp.errors import CcexpError
from ccexp.names import RunIdentity
from ccexp.launch.resume import find_resume, release_claims, write_run_json

NAME = "random-k4-s0-abcd"
DIGEST = "abcd" + "0" * 60
IDENT = RunIdentity(NAME, DIGEST)


@pytest.fixture(autouse=True)
def _claims():
    yield
    release_claims()  # find_resume claims the configuration, as a run does; the run's end releases it


def make_run(outputs: Path, stamp: str, status: str | None, *, checkpoint: bool = True, started: float | None = None,
             name: str = NAME, pid: int | None = None, metrics: dict | None = None, digest: str | None = DIGEST) -> Path:
    """A run folder under ``outputs/runs`` with its run.json (``status`` None: one written before run states;
    ``digest`` its configuration's, None: one written before ccexp recorded it) and, with ``checkpoint``, a readable
    last.ckpt (a zip archive, as Lightning writes)."""
    folder = outputs / "runs" / "2026-12-04" / stamp
    (folder / "checkpoints").mkdir(parents=True)
    meta = {"run_name": name, "mlflow_run_id": f"id-{stamp}", **({"config_digest": digest} if digest else {})}
    if status is not None:
        meta.update(status=status, started=started if started is not None else time.time(), steps=20,
                    host=__import__("socket").gethostname(), pid=pid or 999_999_999, metrics=metrics or {})
    (folder / "run.json").write_text(json.dumps(meta))
    if checkpoint:
        with zipfile.ZipFile(folder / "checkpoints" / "last.ckpt", "w") as z:
            z.writestr("archive/data.pkl", b"x")
    return folder


def test_a_finished_configuration_has_nothing_to_do_whatever_asks(tmp_path):
    done = make_run(tmp_path, "10-00-00-1", "finished", metrics={"ppl": 12.5})
    for value in (None, "last", "auto"):
        resume = find_resume(value, IDENT, None, tmp_path)
        assert resume.finished is not None and resume.finished.folder == done and resume.checkpoint is None, value
    assert find_resume("fresh", IDENT, None, tmp_path).finished is None  # fresh: from step 0, always


def test_a_stopped_configuration_continues_from_its_checkpoint_and_its_mlflow_run(tmp_path):
    make_run(tmp_path, "10-00-00-1", "finished", started=1.0)
    stopped = make_run(tmp_path, "11-00-00-2", "stopped", started=2.0)
    for value in (None, "last", "auto"):
        resume = find_resume(value, IDENT, None, tmp_path)
        assert resume.checkpoint == str(stopped / "checkpoints" / "last.ckpt") and resume.run_id == "id-11-00-00-2"
        assert resume.finished is None
    assert find_resume("fresh", IDENT, None, tmp_path).checkpoint is None


def test_last_never_takes_the_checkpoint_of_a_run_older_than_the_newest_finished_one(tmp_path):
    """The issue's third run: resume_from=last picked the finished run's step-400 checkpoint and trained 0 steps."""
    make_run(tmp_path, "09-00-00-1", "stopped", started=1.0)  # continued later by the finished run
    make_run(tmp_path, "10-00-00-2", "finished", started=2.0)
    assert find_resume("last", IDENT, None, tmp_path).finished is not None
    assert find_resume("auto", IDENT, None, tmp_path).finished is not None


def test_nothing_to_continue(tmp_path):
    assert find_resume(None, IDENT, None, tmp_path).checkpoint is None
    assert find_resume("auto", IDENT, None, tmp_path).checkpoint is None
    with pytest.raises(CcexpError, match="no readable checkpoint of an unfinished run named"):
        find_resume("last", IDENT, None, tmp_path)
    make_run(tmp_path, "10-00-00-1", "stopped", checkpoint=False)  # stopped before its first checkpoint
    assert find_resume(None, IDENT, None, tmp_path) == find_resume("auto", IDENT, None, tmp_path)
    assert find_resume(None, IDENT, None, tmp_path).checkpoint is None
    make_run(tmp_path, "10-00-00-2", "stopped", name="other-k4-s1-ffff")  # another configuration's
    assert find_resume(None, IDENT, None, tmp_path).checkpoint is None


def test_runs_from_before_run_states_are_continued_only_when_asked(tmp_path):
    old = make_run(tmp_path, "10-00-00-1", None)
    assert find_resume(None, IDENT, None, tmp_path).checkpoint is None  # not guessed at: a fresh start
    assert find_resume("last", IDENT, None, tmp_path).checkpoint == str(old / "checkpoints" / "last.ckpt")


def test_a_sweep_job_continues_its_own_folder_by_default_and_on_auto_and_fresh_starts_it_again(tmp_path):
    job = make_run(tmp_path, "10-00-00-1", "stopped")
    own = str(job / "checkpoints" / "last.ckpt")
    assert find_resume(None, IDENT, job, tmp_path, multirun=True).checkpoint == own
    assert find_resume("auto", IDENT, job, tmp_path, multirun=True).checkpoint == own
    assert find_resume("fresh", IDENT, job, tmp_path, multirun=True).checkpoint is None
    # a stopped run of the same configuration in another folder is not this job's
    assert find_resume(None, IDENT, tmp_path / "multirun" / "d" / "t" / "job", tmp_path, multirun=True).checkpoint is None


def test_a_run_of_the_configuration_still_going_here_is_refused_and_a_dead_one_continued(tmp_path):
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        try:
            make_run(tmp_path, "10-00-00-1", "running", pid=alive.pid)
            for value in (None, "fresh", "last"):  # one run of a configuration at a time, whatever is asked
                with pytest.raises(CcexpError, match=rf"{NAME} is running now \(pid {alive.pid}"):
                    find_resume(value, IDENT, None, tmp_path)
        finally:
            alive.kill()
    alive.wait()
    # its process is gone (killed hard: run.json still says running): its checkpoint is continued
    assert find_resume(None, IDENT, None, tmp_path).checkpoint.endswith("last.ckpt")


def test_write_run_json_merges_and_records_the_start_once(tmp_path):
    write_run_json(tmp_path, run_name=NAME, status="running")
    first = json.loads((tmp_path / "run.json").read_text())
    write_run_json(tmp_path, status="finished", step=20, metrics={"ppl": 3.0})
    after = json.loads((tmp_path / "run.json").read_text())
    assert after["run_name"] == NAME and after["status"] == "finished" and after["step"] == 20
    assert after["started"] == first["started"] and after["pid"] == first["pid"] and after["metrics"] == {"ppl": 3.0}


# ------------------------------------------------------------------------------------- the whole story
@pytest.mark.slow
def test_stop_then_the_same_command_continues_then_a_finished_one_does_nothing(tmp_path, monkeypatch):
    """A run a callback stops after 7 steps of each launch (``helpers.StopAfterSteps``): the same command again
    says it continues and does (step 14), again (20, FINISHED); again: ``finished ...; nothing to do``, exit 0,
    still one MLflow run; ``train.resume_from=last`` likewise; ``train.resume_from=fresh`` trains a second run."""
    from conftest import ROOT
    from test_cases import ccexp, runs

    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))  # the jobs import helpers.StopAfterSteps
    command = ["round4.jsonl", "sampler=random", "+callbacks.stop._target_=helpers.StopAfterSteps",
               "+callbacks.stop.steps=7"]
    first = ccexp(tmp_path, *command)
    assert first.returncode == 75 and "run the same command again to continue it" in first.stderr, first.stderr[-2000:]
    second = ccexp(tmp_path, *command)
    log = second.stdout + second.stderr
    assert second.returncode == 75, log[-2000:]
    assert re.search(r"resume: \S+ stopped \(step 7 of 20, .*\): continuing it from .*last\.ckpt; "
                     r"train\.resume_from=fresh starts again from step 0", log), log[-3000:]
    third = ccexp(tmp_path, *command)
    assert third.returncode == 0, third.stderr[-2000:]
    client, (run,) = runs(tmp_path / "out")
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "2"
    for extra in ([], ["train.resume_from=last"], ["train.resume_from=auto"]):
        again = ccexp(tmp_path, *command, *extra)
        log = again.stdout + again.stderr
        assert again.returncode == 0, log[-2000:]
        assert re.search(r"finished \(step 20 of 20, .*MLflow run " + run.info.run_id + r"; held-out ppl [\d.]+, "
                         r"ppl_macro [\d.]+\); nothing to do", log), log[-2000:]
        assert "train: step" not in log and "embed:" not in log  # nothing computed, not even a stage
        assert len(runs(tmp_path / "out")[1]) == 1
    fresh = ccexp(tmp_path, *command, "train.resume_from=fresh")
    assert fresh.returncode == 75 and len(runs(tmp_path / "out")[1]) == 2


def test_a_newer_attempt_that_left_no_checkpoint_does_not_undo_a_finished_run(tmp_path):
    """Found by trying to break it: a mistyped train.resume_from failed after the finished run, and the plain
    command then trained the finished configuration again from step 0."""
    done = make_run(tmp_path, "10-00-00-1", "finished", started=1.0)
    make_run(tmp_path, "11-00-00-2", "failed", started=2.0, checkpoint=False)
    make_run(tmp_path, "12-00-00-3", "stopped", started=3.0, checkpoint=False)
    for value in (None, "last", "auto"):
        assert find_resume(value, IDENT, None, tmp_path).finished.folder == done, value


def test_a_run_json_of_the_wrong_shape_is_left_out_with_a_line_not_a_traceback(tmp_path, caplog):
    make_run(tmp_path, "10-00-00-1", "finished", started=1.0)
    odd = make_run(tmp_path, "11-00-00-2", "stopped", started=2.0)
    for text in ("[]", "null", "7", "garbage{{{"):
        (odd / "run.json").write_text(text)
        with caplog.at_level("WARNING", logger="ccexp"):
            assert find_resume(None, IDENT, None, tmp_path).finished is not None
        assert f"resume: {odd / 'run.json'} is not readable" in caplog.text
        caplog.clear()
    # a run.json with odd values: described without them, a pid that is not a number is not a live process
    (odd / "run.json").write_text(json.dumps({"run_name": NAME, "status": "running", "host": __import__("socket")
                                              .gethostname(), "pid": "abc", "step": "x", "steps": "y",
                                              "started": 3.0, "config_digest": DIGEST}))
    resume = find_resume(None, IDENT, None, tmp_path)
    assert resume.checkpoint == str(odd / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize("value, line", [
    ("lastt", "train.resume_from='lastt' is not an option; did you mean 'last'?"),
    ("LAST", "train.resume_from='LAST' is not an option; did you mean 'last'?"),
    ("", "train.resume_from='': no such checkpoint; train.resume_from takes last, auto, fresh or a checkpoint's path"),
    ("/no/such.ckpt", "train.resume_from='/no/such.ckpt': no such checkpoint"),
])
def test_a_bad_resume_from_is_one_line_before_any_stage(tmp_path, value, line):
    from ccexp.preflight import check_resume_from

    with pytest.raises(CcexpError) as e:
        check_resume_from(value)
    assert str(e.value).startswith(line)
    with pytest.raises(CcexpError, match="is a folder, not a checkpoint"):
        check_resume_from(str(tmp_path))
    (tmp_path / "x.ckpt").write_bytes(b"")
    for ok in (None, "last", "auto", "fresh", str(tmp_path / "x.ckpt")):
        check_resume_from(ok)


def test_a_run_finished_on_a_corpus_that_changed_since_is_not_this_run(tmp_path, caplog):
    """Found with an object-store corpus rewritten in place: the same settings, another corpus fingerprint."""
    done = make_run(tmp_path, "10-00-00-1", "finished", started=1.0)
    meta = json.loads((done / "run.json").read_text())
    (done / "run.json").write_text(json.dumps({**meta, "fingerprints": {"corpus": "aaaa", "embed": "e"}}))
    assert find_resume(None, IDENT, None, tmp_path, fingerprints={"corpus": "aaaa"}).finished is not None
    with caplog.at_level("INFO", logger="ccexp"):
        resume = find_resume(None, IDENT, None, tmp_path, fingerprints={"corpus": "bbbb"})
    assert resume.finished is None and resume.checkpoint is None  # from step 0, on the new corpus
    assert "on another corpus (fingerprint aaaa, now bbbb)" in caplog.text
