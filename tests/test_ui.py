"""python -m ccexp.ui: the MLflow UI opened at the view that compares the latest sweep (a real SQLite store)."""
from __future__ import annotations

import json
import socket
import urllib.request

import pytest


def sweep_store(tmp_path, samplers=("random", "uniform"), seeds=(0, 1)):
    """A store with one older sweep and a newer one, each with a run per sampler and seed."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("ccexp", artifact_location=str(tmp_path / "mlartifacts"))
    parents = []
    for sweep in range(2):
        parent = client.create_run(exp, run_name=f"sweep-{sweep}", tags={"ccexp.sweep": "true"}).info.run_id
        for sampler in samplers:
            for seed in seeds:
                run = client.create_run(exp, run_name=f"{sampler}-s{seed}", tags={"mlflow.parentRunId": parent})
                client.log_param(run.info.run_id, "sampler.name", sampler)
                client.log_param(run.info.run_id, "seed", seed)
                for metric in ("eval/ppl", "eval/ppl_macro", "eval/bpb"):
                    client.log_metric(run.info.run_id, metric, 100.0 + seed + sweep)
                client.set_terminated(run.info.run_id)
        killed = client.create_run(exp, run_name="random-s9", tags={"mlflow.parentRunId": parent})  # left RUNNING
        client.log_param(killed.info.run_id, "sampler.name", "random")
        parents.append(parent)
    return client, exp, parents


def test_the_view_compares_the_latest_sweeps_runs_by_sampler_on_the_headline_metrics(tmp_path):
    from ccexp.ui import SHARED_VIEW, compare_view

    client, exp, (older, latest) = sweep_store(tmp_path)
    experiment_id, key, metrics = compare_view(client)
    assert experiment_id == exp and metrics == ["eval/ppl", "eval/ppl_macro", "eval/bpb"]
    state = json.loads(client.get_experiment(exp).tags[SHARED_VIEW + key])
    assert state["searchFilter"] == f"tags.`mlflow.parentRunId` = '{latest}' and attributes.status = 'FINISHED'"
    assert state["selectedColumns"][:3] == ["metrics.`eval/ppl`", "metrics.`eval/ppl_macro`", "metrics.`eval/bpb`"]
    assert state["orderByKey"] == "metrics.`eval/bpb`" and state["orderByAsc"] is True  # the question first
    assert state["groupBy"]["groupByKeys"] == [{"mode": "param", "groupByData": "sampler.name"}]
    # the filter selects exactly the latest sweep's runs
    runs = client.search_runs([exp], state["searchFilter"])
    assert len(runs) == 4 and {r.data.tags["mlflow.parentRunId"] for r in runs} == {latest}
    _, older_key, _ = compare_view(client, parent=older)
    assert older in json.loads(client.get_experiment(exp).tags[SHARED_VIEW + older_key])["searchFilter"]


def test_ui_without_a_store_or_experiment_is_one_line(tmp_path, capsys):
    from ccexp.ui import main

    with pytest.raises(SystemExit) as e:
        main(["--store", str(tmp_path / "none.db"), "--no-server"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"ccexp.ui: error: no MLflow store at {tmp_path / 'none.db'}; run ccexp first or pass --store / --tracking-uri"
    for name, content in (("empty.db", b""), ("corpus.jsonl", b'{"text": "a"}\n')):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(SystemExit):
            main(["--store", str(tmp_path / name), "--no-server"])
        assert "is not an MLflow store (not a SQLite database)" in capsys.readouterr().err
        assert (tmp_path / name).read_bytes() == content  # a viewer never writes into a file it was given
    sweep_store(tmp_path)
    with pytest.raises(SystemExit):
        main(["--store", str(tmp_path / "mlflow.db"), "--experiment", "nope", "--no-server"])
    assert "no MLflow experiment 'nope' in this store; pass --experiment (the store has Default, ccexp)" in capsys.readouterr().err


def test_no_server_prints_the_address_of_the_view_and_of_the_sweeps_parent_run(tmp_path, capsys):
    from ccexp.ui import main

    from ccexp.ui import default_host, url_host

    _, exp, (_, latest) = sweep_store(tmp_path)
    main(["--store", str(tmp_path / "mlflow.db"), "--no-server", "--port", "5123"])
    out = capsys.readouterr().out.splitlines()
    root = f"http://{url_host(default_host())}:5123/#/experiments/{exp}"
    assert out[1].startswith(f"{root}/runs?viewStateShareKey=ccexp-")
    assert out[1].endswith("&workflowType=machine_learning")
    assert f"{root}/runs/{latest}?workflowType=machine_learning" in "\n".join(out)  # the sweep's parent run
    main([f"paths.outputs={tmp_path}", "--no-server", "--port", "5123"])  # the run's own way to name its outputs
    assert capsys.readouterr().out.splitlines() == out


def test_the_ui_serves_on_the_ipv6_loopback_where_there_is_one():
    """MLflow opens its Assistant panel over a third of the page at a server it takes for local by name
    (127.0.0.1, localhost); at [::1] it stays closed (checked in headless Chromium: docs/ui/)."""
    import socket

    from ccexp.ui import default_host, url_host

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        assert default_host() == "::1" and url_host("::1") == "[::1]"
    except OSError:
        assert default_host() == "127.0.0.1"
    assert url_host("127.0.0.1") == "127.0.0.1"


def test_the_view_leads_with_the_rounded_headline_metrics_and_charts_a_bar_per_sampler(tmp_path):
    from ccexp.evaluation.heldout import is_headline_key
    from ccexp.ui import SHARED_VIEW, compare_view

    client, exp, (_, latest) = sweep_store(tmp_path)
    for run in client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{latest}'"):
        for key in ("ppl", "macro ppl", "worst ppl", "macro vs random pct", "macro vs random pct ci", "ppl vs random pct"):
            client.log_metric(run.info.run_id, key, 1.25)
    _, key, metrics = compare_view(client)  # runs from before bits per byte's copy: macro ppl's column leads
    assert metrics == ["macro ppl", "macro vs random pct", "macro vs random pct ci", "ppl", "ppl vs random pct", "worst ppl"]
    assert json.loads(client.get_experiment(exp).tags[SHARED_VIEW + key])["orderByKey"] == "metrics.`macro ppl`"
    for run in client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{latest}'"):
        for key in ("bpb", "bpb vs random pct", "bpb vs random pct ci"):  # the question's, sorting first
            client.log_metric(run.info.run_id, key, 1.25)
    _, key, metrics = compare_view(client)
    assert metrics == ["bpb", "bpb vs random pct", "bpb vs random pct ci", "macro ppl", "macro vs random pct",
                       "macro vs random pct ci", "ppl", "ppl vs random pct", "worst ppl"]
    assert all(map(is_headline_key, metrics)) and not is_headline_key("eval/ppl_macro")
    state = json.loads(client.get_experiment(exp).tags[SHARED_VIEW + key])
    assert state["selectedColumns"][:9] == [f"metrics.`{m}`" for m in metrics]
    assert state["orderByKey"] == "metrics.`bpb`" and state["orderByAsc"] is True
    charts = state["compareRunCharts"]  # the chart view: one bar chart per headline column, in their order
    assert [(c["type"], c["metricKey"]) for c in charts] == [("BAR", m) for m in metrics if not m.endswith(" ci")]
    assert state["compareRunSections"][0]["uuid"] == charts[0]["metricSectionId"]
    assert state["isAccordionReordered"] is True  # else the UI sorts sections by name and "cache" comes first


def test_a_sweep_with_verdicts_is_grouped_by_them_without_a_mean_seed_and_printed_as_charts(tmp_path, capsys):
    from ccexp.compare.verdict import VERDICT_TAG
    from ccexp.ui import SHARED_VIEW, compare_view, main

    client, exp, (_, latest) = sweep_store(tmp_path)
    _, key, _ = compare_view(client)  # a sweep without verdicts (from before them): by sampler, seed shown
    state = json.loads(client.get_experiment(exp).tags[SHARED_VIEW + key])
    assert state["groupBy"]["groupByKeys"] == [{"mode": "param", "groupByData": "sampler.name"}]
    for run in client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{latest}'"):
        sampler = run.data.params["sampler.name"]
        client.set_tag(run.info.run_id, VERDICT_TAG, "random: the baseline" if sampler == "random" else
                       "uniform: unresolved on macro ppl, +6.6% ± 280.0% vs random (2 seeds)")
    _, key, _ = compare_view(client)
    state = json.loads(client.get_experiment(exp).tags[SHARED_VIEW + key])
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": VERDICT_TAG}]  # each group: its verdict
    assert "params.`seed`" not in state["selectedColumns"]  # a group row would show the mean seed, 0.5
    main(["--store", str(tmp_path / "mlflow.db"), "--no-server"])
    lines = capsys.readouterr().out.splitlines()
    assert "legend names its sampler's verdict" in lines[0] and lines[1].endswith(f"{key}&workflowType=machine_learning&compareRunsMode=CHART")
    assert lines[3].endswith(f"{key}&workflowType=machine_learning")  # the table after it


@pytest.mark.slow
def test_the_served_ui_holds_the_view_it_prints(tmp_path):
    from ccexp.ui import SHARED_VIEW, compare_view, serve

    client, exp, _ = sweep_store(tmp_path)
    _, key, _ = compare_view(client)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = serve(f"sqlite:///{tmp_path / 'mlflow.db'}", "127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/get?experiment_id={exp}"
        tags = {t["key"]: t["value"] for t in json.load(urllib.request.urlopen(url, timeout=30))["experiment"]["tags"]}
        assert json.loads(tags[SHARED_VIEW + key])["groupBy"]["groupByKeys"][0]["groupByData"] == "sampler.name"
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).read().decode()
        assert "<html" in page.lower()  # the UI itself is served
    finally:
        proc.terminate()
        proc.wait(timeout=30)
