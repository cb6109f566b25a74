"""What a newcomer's first run shows at its end and on the console: the time of each phase (the ``time:``
line, ``timing.json`` and the ``time/phase_*`` metrics), the balance report named on the ``done:`` line, and
a warning of a local sweep once on the console however many of its jobs repeat it (each job's log keeps it)."""
from __future__ import annotations

import io
import json
import logging

from ccexp.runtime import OnceOnTheConsole, Phases, once_on_the_console


def test_the_phases_add_up_to_the_total_and_the_line_gives_each_share(tmp_path):
    phases = Phases(since=0.0)  # since the epoch of perf_counter: a large start phase, as a process's would be
    phases.seconds = {"start": 10.0}
    phases.seconds.update({"embed": 30.0, "train": 59.7, "eval": 0.2})
    assert phases.total == 99.9
    assert phases.line() == "time: 100 s = start 10 s (10%) · embed 30 s (30%) · train 60 s (60%)"  # eval < 0.5 s
    metrics = phases.metrics()  # marks the reports phase first
    assert set(metrics) == {"time/phase_start_seconds", "time/phase_embed_seconds", "time/phase_train_seconds",
                            "time/phase_eval_seconds", "time/phase_reports_seconds", "time/total_seconds"}
    assert metrics["time/total_seconds"] == sum(v for k, v in metrics.items() if k.startswith("time/phase_"))
    written = json.loads(phases.write(tmp_path / "timing.json", {"embed": "abc"}).read_text())
    assert written["seconds"]["embed"] == 30.0 and written["stages"] == {"embed": "abc"}


def test_the_done_line_names_the_balance_report_when_there_is_one(tmp_path, caplog):
    (tmp_path / "balance").mkdir()
    (tmp_path / "balance" / "balance.md").write_text("# balance\n")
    with caplog.at_level(logging.INFO, logger="ccexp"):
        Phases(since=0.0).done("random-k8-s0", 2.0, 4096, tmp_path)
    time_line, done_line = caplog.messages[-2:]
    assert time_line.startswith("time: ") and done_line.startswith("done: random-k8-s0 in ")
    assert done_line.endswith(f"; balance report: {tmp_path / 'balance' / 'balance.md'}")
    assert "2048 tokens/s" in done_line


def test_a_repeated_warning_reaches_the_console_once_and_every_log_file(tmp_path):
    root = logging.getLogger()
    stream = io.StringIO()
    console = logging.StreamHandler(stream)
    file_handler = logging.FileHandler(tmp_path / "job.log")
    root.addHandler(console)
    root.addHandler(file_handler)
    try:
        once_on_the_console()
        once_on_the_console()  # the same job again: not a second filter
        assert sum(isinstance(f, OnceOnTheConsole) for f in console.filters) == 1 and not file_handler.filters
        log = logging.getLogger("ccexp.test_first_run")
        log.setLevel(logging.INFO)
        for _ in range(3):  # three jobs of one sweep, each warning the same; Hydra gives each job new handlers
            log.warning("corpus: label field 'x' is missing")
            log.info("each job's own line")
            root.removeHandler(console)
            console = logging.StreamHandler(stream)
            root.addHandler(console)
            once_on_the_console()
        log.warning("another warning")
    finally:
        root.removeHandler(console)
        root.removeHandler(file_handler)
        file_handler.close()
    shown = stream.getvalue().splitlines()
    assert shown.count("corpus: label field 'x' is missing") == 1 and shown.count("each job's own line") == 3
    assert "another warning" in shown
    assert (tmp_path / "job.log").read_text().count("corpus: label field 'x' is missing") == 3
