"""The comparison report says only what its runs support: no interval from one seed, every label value
listed, identical streams named, cost kept apart from quality, paired differences by seed."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.compare.report import Comparison
from ccexp.compare.budget import device_time
from ccexp.compare.verdict import verdict_lines


def run(sampler: str, seed: int, metrics: dict, digest: str = ""):
    return SimpleNamespace(data=SimpleNamespace(metrics={"train/tokens": 4096.0, **metrics}, params={"seed": str(seed)},
                                                tags={"sampler": sampler, "stream_digest": digest}))


def comparison(runs):
    return Comparison.of(runs, title="t", group_by="sampler", baseline="random", require_baseline=False)


def test_one_seed_gets_no_interval_and_says_so():
    c = comparison([run("random", 0, {"eval/ppl": 10.0}), run("uniform", 0, {"eval/ppl": 9.0})])
    md = c.markdown()
    assert c.cell("eval/ppl", "uniform") == "9 (1 seed)" and "±" not in md.split("## Every metric")[1].split("## Paired")[0]
    assert "**unresolved** -10.0% (-1, 1 pair: no interval)" in md  # no CI from one pair
    assert "n/a" not in md and "### Next: a second seed" in md and "+sweep=sampler_seeds" in md  # what comes next
    assert math.isnan(c.paired["eval/ppl"]["uniform"]["half"]) and not c.paired["eval/ppl"]["uniform"]["significant"]
    assert "nan" not in md.lower()  # no noise from one seed: said, not printed as nan


def test_report_html_claims_no_interval_for_one_seed_and_leads_with_the_verdict():
    import re

    one = comparison([run("random", 0, {"eval/ppl": 10.0}), run("uniform", 0, {"eval/ppl": 9.0})]).html()
    text = re.sub(r"<[^>]+>", "", one)
    table = text.split("Every metric")[1].split("Paired")[0]
    assert "means only, no confidence interval" in table and "±" not in table and "9 (1 seed)" in table
    assert text.index("unresolved") < text.index("Every metric")  # the verdict comes first
    two = comparison([run(s, k, {"eval/ppl": 10.0 + k + (s == "uniform") * 0.5}) for s in ("random", "uniform")
                      for k in range(2)]).html()
    assert "10.5 ± 6.4 (n=2)" in re.sub(r"<[^>]+>", "", two)  # with two seeds, the interval


def test_paired_differences_pair_runs_by_seed():
    runs = [run("random", s, {"eval/ppl": 10.0 + s}) for s in range(3)]
    runs += [run("uniform", s, {"eval/ppl": 9.0 + s + 0.01 * s}) for s in range(3)]
    d = comparison(runs).paired["eval/ppl"]["uniform"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(-0.99) and d["significant"]  # a steady -1 across seeds


def test_a_label_value_without_held_out_documents_is_listed_not_dropped():
    m = {"eval/ppl_domain/a": 5.0, "eval/heldout_docs_domain/a": 3.0, "eval/heldout_docs_domain/b": 0.0}
    c = comparison([run("random", 0, m), run("uniform", 0, m)])
    assert "eval/ppl_domain/b" in c.metrics and c.cell("eval/ppl_domain/b", "random") == "no held-out documents"


def test_identical_streams_are_named_and_cost_is_kept_apart():
    runs = [run("uniform", 0, {"eval/ppl": 9.0, "train/tokens_per_s": 100.0}, "abc"),
            run("clusterclip", 0, {"eval/ppl": 9.0, "train/tokens_per_s": 90.0}, "abc"),
            run("random", 0, {"eval/ppl": 10.0, "train/tokens_per_s": 95.0}, "def")]
    c = comparison(runs)
    assert c.notes == ["clusterclip, uniform trained on the identical token stream (seed 0): the sampling policies "
                       "made no difference there"]
    assert "train/tokens_per_s" not in c.metrics and c.cost == ["train/tokens_per_s"]
    md = c.markdown()
    assert md.index("## Cost") > md.index("| eval/ppl |") and "train/tokens_per_s" not in c.paired


def test_the_verdict_names_every_label_value_it_cannot_score():
    """Issue 34: a rare domain with no held-out document vanished from the verdict table without a word."""
    m = {"eval/ppl": 10.0, "eval/ppl_domain/a": 5.0, "eval/heldout_docs_domain/a": 3.0,
         "eval/heldout_docs_domain/rare": 0.0, "eval/heldout_docs_domain/gone": 0.0}
    c = comparison([run("random", 0, m), run("uniform", 0, {**m, "eval/ppl": 9.0})])
    verdict = c.markdown().split("### Signal")[0]
    line = next(ln for ln in verdict.splitlines() if ln.startswith("Not scored"))
    assert "ppl of domain = gone; ppl of domain = rare" in line and "data.heldout_stratify" in line
    assert "domain = a" not in line  # scored: it has its verdict row
    assert "| ppl of domain = a (3 held-out docs: too few to read) |" in verdict
    nothing = comparison([run("random", 0, {"eval/ppl": 10.0}), run("uniform", 0, {"eval/ppl": 9.0})])
    assert "Not scored" not in nothing.markdown()


def test_a_one_seed_sweep_gives_the_command_that_adds_a_second_seed_and_no_table_of_na():
    labels = {f"eval/ppl_domain/d{i}": 10.0 + i for i in range(20)}  # many rows: none repeats "n/a" per sampler
    runs = [run(s, 0, {"eval/ppl": 10.0 + (s == "uniform"), "eval/ppl_macro": 11.0, **labels})
            for s in ("random", "uniform", "clusterclip")]
    c = Comparison.of(runs, title="t", group_by="sampler", baseline="random", require_baseline=False,
                      sweep_dir=Path("/sweeps/smoke"), task_overrides=["+recipe=smoke", "data.path=my.jsonl"])
    rows, command = c.verdict()
    assert command.endswith("-m ccexp -m +recipe=smoke data.path=my.jsonl seed=0,1 hydra.sweep.dir=/sweeps/smoke")
    md = c.markdown()
    assert md.count(command) == 1 and "n/a" not in md and "Signal, noise" not in md
    lines = verdict_lines(c, rows, command)
    assert lines[-1] == f"  one seed decides nothing; add a second: {command}"


def test_a_curve_still_moving_at_the_end_is_named_from_the_real_store(tmp_path):
    """random's held-out macro ppl rises 30 % over the last fifth of its tokens, uniform's falls 1 % (under the
    report's 2 %): the report and the sweep's last lines name random only, with its change and its tokens."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from ccexp.compare.report import write_report

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("ccexp")
    curves = {"random": [100.0, 60.0, 55.0, 50.0, 65.0], "uniform": [100.0, 60.0, 55.0, 50.0, 49.5]}
    for seed in (0, 1):
        for sampler, curve in curves.items():
            r = client.create_run(exp, run_name=f"{sampler}-s{seed}", tags={"sampler": sampler})
            client.log_param(r.info.run_id, "seed", seed)
            client.log_batch(r.info.run_id, metrics=[Metric("curve/ppl_macro", v * (1 + seed / 100), 0, 200_000 * i)
                                                     for i, v in enumerate(curve)]
                             + [Metric("eval/ppl_macro", curve[-1] + seed, 0, 0), Metric("train/tokens", 8e5, 0, 0),
                                Metric("eval/bpb", (curve[-1] + seed) / 50, 0, 0)])
            client.set_terminated(r.info.run_id)
    files, c = write_report(client, out_dir=tmp_path / "report")
    assert list(c.moving) == ["random"] and c.moving["random"] == (pytest.approx(65 / 50 - 1), 600_000, 800_000)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "still moving when training stopped" in md and "random +30% (0.60M → 0.80M tokens)" in md
    assert "uniform -" not in md.split("still moving")[1].split("\n")[0] and "Rising (random)" in md
    assert any("random +30% from 0.60M to 0.80M tokens" in line for line in verdict_lines(c, *c.verdict()))


def test_a_jump_between_the_tails_evaluations_counts_as_still_moving():
    """Evaluations every 100k tokens: the curve is back within 1 % of its value at the tail's start by the end,
    but rose 60 % in between; the point farthest from the last is reported, not the tail's first."""
    from ccexp.compare.report import still_moving

    jump = [100.0, 80.0, 70.0, 60.0, 55.0, 52.0, 50.0, 80.0, 50.5]
    steady = [100.0, 80.0, 70.0, 60.0, 55.0, 52.0, 50.0, 50.2, 50.5]
    histories = {(g, "curve/ppl_macro"): [{100_000 * i: v for i, v in enumerate(curve)}]
                 for g, curve in (("random", jump), ("uniform", steady))}
    moving = still_moving(histories, 0.02)
    assert list(moving) == ["random"] and moving["random"] == (pytest.approx(50.5 / 80 - 1), 700_000, 800_000)


def test_the_command_that_adds_seeds_states_its_cost_and_a_much_cheaper_metric_is_named():
    """Issue 44's third point: the extension command comes with its cost at this sweep's own measured speed (runs,
    tokens, hours), and a headline metric that needs at most half the primary's seeds is named."""
    from ccexp.compare.verdict import PRIMARY

    timing = {"train/tokens_per_s": 1000.0, "time/total_seconds": 10.0, "time/train_seconds": 4.0}
    noisy = {("random", 0): 10.0, ("random", 1): 10.0, ("uniform", 0): 10.5, ("uniform", 1): 9.6}
    steady = {("random", 0): 1.0, ("random", 1): 1.0, ("uniform", 0): 0.99, ("uniform", 1): 0.989}
    runs = [run(s, i, {PRIMARY: noisy[s, i], "eval/ppl": steady[s, i], "eval/ppl_macro": steady[s, i], **timing})
            for s in ("random", "uniform") for i in (0, 1)]
    c = Comparison.of(runs, title="t", group_by="sampler", baseline="random", require_baseline=False,
                      sweep_dir=Path("/sweeps/s"), task_overrides=["hydra/launcher=packed", "seed=0,1"])
    rows, command = c.verdict()
    assert " -m ccexp -m hydra/launcher=packed 'seed=range(0," in command
    more = 2 * (c.wanted - 2)  # two runs (random, uniform) per new seed
    hours = more * (4096 / 1000 + 6) / 3600
    cost = (f"{more:,} more run(s) of 4,096 tokens: about {device_time(hours)} one after another (this sweep's "
            "median 1,000 tokens/s and 6 s outside training per run)")
    assert c.extension_cost() == cost
    lines = verdict_lines(c, rows, command)
    assert f"(report.min_effect) ({cost}): {command}" in "\n".join(lines)
    need = {r.metric: r.seeds_min_effect for r in rows}
    assert need["eval/ppl"] * 2 <= need[PRIMARY] and need["eval/ppl_macro"] == need["eval/ppl"]
    # the cheaper metric named is overall ppl, never macro ppl (which favours balancing by construction)
    assert any(line.startswith(f"  overall ppl needs about {need['eval/ppl']:,} seeds to detect the same share "
                               f"where bits per byte needs {need[PRIMARY]:,}") for line in lines)
    assert cost in c.markdown()
    # without a measured speed there is no figure to give, and no cost is made up
    bare = Comparison.of([run(s, i, {PRIMARY: noisy[s, i]}) for s in ("random", "uniform") for i in (0, 1)],
                         title="t", group_by="sampler", baseline="random", require_baseline=False,
                         sweep_dir=Path("/sweeps/s"), task_overrides=["seed=0,1"])
    bare.verdict()
    assert bare.extension_cost() is None


def test_each_label_value_says_how_many_held_out_documents_it_rests_on_and_few_are_marked():
    """Issue 44's fifth point: a rare label value's perplexity on 2 held-out documents is not read like one on 300:
    the verdict's rows give the count (the fewest over runs) and mark fewer than 20 too few to read."""
    from ccexp.compare.verdict import FEW_HELDOUT_DOCS

    def metrics(seed, shift):
        return {"eval/ppl": 10.0 + shift + seed / 10, "eval/ppl_domain/perl": 12.0 + shift - seed / 7,
                "eval/ppl_domain/bible": 9.0 + shift + seed / 9, "eval/heldout_docs_domain/perl": 2.0 + seed,
                "eval/heldout_docs_domain/bible": 300.0}

    c = comparison([run(s, i, metrics(i, 0.1 * (s == "uniform"))) for s in ("random", "uniform") for i in (0, 1)])
    md = c.markdown()
    assert "| ppl of domain = perl (2 held-out docs: too few to read) |" in md
    assert "| ppl of domain = bible (300 held-out docs) |" in md
    assert f"Scored on fewer than {FEW_HELDOUT_DOCS} held-out documents, too few to read a difference from: " \
           "ppl of domain = perl (2)." in md
    assert c.heldout_documents("eval/ppl") is None and c.heldout_documents("eval/ppl_domain/perl") == 2


def test_each_sampler_gets_its_verdict_in_one_line_and_the_per_run_differences_average_to_it():
    from ccexp.compare.report import headline_differences
    from ccexp.compare.verdict import arm_verdicts

    both = lambda v: {"eval/ppl_macro": v, "eval/bpb": v / 100}  # noqa: E731 (the question is bits per byte)
    runs = [run("random", s, both(100.0 + 10 * s)) for s in range(3)]
    runs += [run("uniform", s, both(90.0 + 10 * s + s)) for s in range(3)]
    for i, r in enumerate(runs):
        r.info = SimpleNamespace(run_id=f"r{i}")
    c = comparison(runs)
    rows, _ = c.verdict()
    words = arm_verdicts(c, rows)
    q = c.paired["eval/bpb"]["uniform"]
    assert words["random"] == "random: the baseline"
    assert words["uniform"] == (f"uniform: better on bits per byte, {q['mean'] / q['baseline_mean']:+.1%} ± "
                                f"{q['half'] / q['baseline_mean']:.1%} vs random (3 seeds)")
    d = c.paired["eval/ppl_macro"]["uniform"]
    values = headline_differences(c)
    mine = [values[f"r{i}"]["macro vs random pct"] for i in range(3, 6)]
    assert [values[f"r{i}"]["macro vs random pct"] for i in range(3)] == [0.0] * 3
    # the mean of uniform's per-run values is the report's difference, not a mean of per-seed ratios
    assert sum(mine) / 3 == pytest.approx(100 * d["mean"] / d["baseline_mean"], abs=0.01)
    assert sum(mine) / 3 != pytest.approx(100 * sum((90 + 11 * s) / (100 + 10 * s) - 1 for s in range(3)) / 3, abs=0.01)
    assert {values[f"r{i}"]["macro vs random pct ci"] for i in range(3, 6)} == {round(100 * d["half"] / d["baseline_mean"], 2)}


def test_compute_time_is_said_in_the_unit_that_reads_it():
    """A 33-run extension of 115 s read "about 0.0 CPU-hours" (a new user's try, 2026-12-07)."""
    assert device_time(115 / 3600) == "2 CPU-minutes" and device_time(40 / 3600, "GPU") == "40 GPU-seconds"
    assert device_time(84.6) == "84.6 CPU-hours" and device_time(1.0) == "1.0 CPU-hours"


def test_an_unresolved_difference_never_says_fewer_seeds_than_were_run_would_resolve_it():
    """'unresolved ... (n=2); about 2 seeds would resolve it' read as a contradiction (a new user's try). Its cause
    was scipy's NaN far tail counted as power (test_stats): with the power computed exactly, a difference these
    seeds did not resolve always needs more seeds than were run, and the line names how many."""
    runs = [run("random", s, {"eval/bpb": 100.0 + [0.0, 3.0][s]}) for s in range(2)]
    runs += [run("uniform", s, {"eval/bpb": [110.0, 115.83][s]}) for s in range(2)]  # 10 and 12.83
    c = comparison(runs)
    rows, command = c.verdict()
    (row,) = [r for r in rows if r.metric == "eval/bpb"]
    assert row.verdict == "unresolved" and row.seeds_observed > row.n == 2
    line = next(ln for ln in verdict_lines(c, rows, command) if ln.strip().startswith("uniform:"))
    assert f"about {row.seeds_observed} seeds would resolve it" in line


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=2, max_size=8))
def test_an_unresolved_differences_seeds_to_resolve_it_are_more_than_the_seeds_run(diffs):
    from ccexp.compare.stats import mean_ci, sample_sd, seeds_to_detect, verdict

    mean, half = mean_ci(diffs)
    sd = sample_sd(diffs)
    if verdict(mean, half) == "unresolved" and sd > 0 and mean != 0:
        assert seeds_to_detect(mean, sd) > len(diffs)


def test_a_store_with_nothing_to_decide_says_so_in_one_line_and_counts_one_run_as_one(tmp_path):
    """One run of the baseline alone: the report's title says "1 run", the lines a sweep and ccexp.report print say
    there is nothing to decide and what to run (they printed an empty line), and the parent run's description names
    the question's metric for its chart (it said macro perplexity after the chart moved to bits per byte)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from ccexp.compare.report import parent_description, write_report

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    r = client.create_run(client.create_experiment("ccexp"), run_name="random-s0", tags={"sampler": "random"})
    client.log_param(r.info.run_id, "seed", 0)
    client.log_batch(r.info.run_id, metrics=[Metric("eval/bpb", 1.5, 0, 0), Metric("train/tokens", 8e5, 0, 0)])
    client.set_terminated(r.info.run_id)
    _, c = write_report(client, out_dir=tmp_path / "report")
    assert c.title == "ccexp comparison: 1 run"
    lines = verdict_lines(c, *c.verdict())
    assert lines == ["verdict against random: nothing to decide (no sampler has a run paired with random's by seed); "
                     "run random and the other samplers with the same seeds"]
    assert "each sampler's bits per byte" in parent_description(c, lines)
