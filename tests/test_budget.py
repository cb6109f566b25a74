"""Issue 33: the report designs the next sweep. On a real MLflow store of synthetic runs whose paired differences
have an SD that falls as budget^-0.5, the report recovers the exponent within its stated uncertainty, names the
cheapest design and the command that runs it; with one budget it says what a second budget would add."""
from __future__ import annotations

import math

import numpy as np
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from ccexp.compare.budget import fit_line, study
from ccexp.compare.report import write_report
from ccexp.compare.stats import seeds_for_half_width

BUDGETS = (100_000, 200_000, 400_000, 800_000, 1_600_000, 3_200_000)  # tokens per run; 1,000 tokens a step
RATE, OUTSIDE = 10_000.0, 30.0  # training tokens/s and seconds outside training, as every run measured them


def sd_at(tokens: float) -> float:
    """The true SD of the paired difference (a share of the baseline's mean): 8 % at 100k tokens, ∝ budget^-0.5."""
    return 0.08 * (tokens / BUDGETS[0]) ** -0.5


def store(tmp_path, budgets=BUDGETS, seeds=range(16), effect=-0.03):
    """random and uniform at each budget and seed: random's macro ppl 100 · (1 + 2 % seed noise); uniform's
    random's · (1 + effect + SD(B) · z), z drawn per run (numpy seed 7)."""
    rng = np.random.default_rng(7)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("ccexp", artifact_location=str(tmp_path / "mlartifacts"))
    for tokens in budgets:
        for seed in seeds:
            base = 100.0 * (1 + 0.02 * rng.standard_normal())
            for sampler, ppl in (("random", base), ("uniform", base * (1 + effect + sd_at(tokens) * rng.standard_normal()))):
                run = client.create_run(exp, run_name=f"{sampler}-s{seed}-{tokens}", tags={"sampler": sampler})
                params = {"seed": seed, "sampler.name": sampler, "train.steps": tokens // 1000, "train.lr": 0.002,
                          "trainer.accelerator": "cpu"}
                metrics = {"eval/ppl_macro": ppl, "eval/ppl": ppl, "train/tokens": tokens, "train/tokens_per_s": RATE,
                           "time/train_seconds": tokens / RATE, "time/total_seconds": tokens / RATE + OUTSIDE}
                client.log_batch(run.info.run_id, metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()],
                                 params=[Param(k, str(v)) for k, v in params.items()])
                client.set_terminated(run.info.run_id)
    return client


def test_a_line_fit_through_two_points_has_no_uncertainty_and_three_points_have_one():
    two = fit_line([0, 1], [1, 3])
    assert (two.slope, two.intercept) == pytest.approx((2.0, 1.0)) and (two.se, two.half) == (None, None)
    three = fit_line([0, 1, 2], [0, 1.1, 1.9])
    assert three.slope == pytest.approx(0.95) and three.se > 0 and three.half > three.se  # t(1) = 12.7
    assert fit_line([1, 1], [0, 1]) is None  # one distinct budget: no slope


def test_the_report_recovers_the_noise_exponent_and_names_the_cheapest_design(tmp_path):
    client = store(tmp_path)
    files, c = write_report(client, out_dir=tmp_path / "report")
    s = c.budgets
    assert sorted({p.tokens for p in s.points}) == list(BUDGETS) and all(p.n == 16 for p in s.points)
    fit = s.noise["uniform"]
    assert fit.points == 6 and fit.half is not None
    assert abs(fit.slope - (-0.5)) <= fit.half  # the true exponent lies within the stated 95 % interval
    assert fit.half < 0.5  # and the interval is narrow enough to say the noise falls
    # each design's seeds follow from its fitted SD, its cost from the measured throughput
    for d in s.designs:
        assert d.sd == pytest.approx(math.exp(fit.intercept + fit.slope * math.log(d.tokens)))
        assert d.seeds_ci == seeds_for_half_width(d.sd, 0.02) and d.runs == 2 * d.seeds_ci
        assert d.hours == pytest.approx(d.runs * (d.tokens / RATE + OUTSIDE) / 3600)
        assert d.hours_power == pytest.approx(2 * d.seeds_power * (d.tokens / RATE + OUTSIDE) / 3600)
    assert [d.tokens for d in s.designs] == [*BUDGETS, 6_400_000, 12_800_000]
    assert [d.extrapolated for d in s.designs] == [False] * 6 + [True] * 2
    cheapest = min(s.designs, key=lambda d: d.hours)
    assert s.cheapest is cheapest and cheapest.tokens > BUDGETS[0]  # more tokens, fewer seeds: cheaper here
    assert s.cheapest_power is min(s.designs, key=lambda d: d.hours_power)
    md = (tmp_path / "report" / "report.md").read_text()
    section = md.split("## Budget and seeds")[1].split("\n## ")[0]
    assert f"| {cheapest.tokens:,} **(cheapest)** | {cheapest.steps:,} |" in section
    assert f"uniform: b = {fit.slope:+.2f} ± {fit.half:.2f} (95 % CI, 6 budgets)" in section
    lines = "\n".join(__import__("ccexp.compare.verdict", fromlist=["x"]).verdict_lines(c, *c.verdict()))
    assert f"cheapest design for ± 2%: {cheapest.seeds_ci} seeds x {cheapest.tokens:,} tokens" in lines


def test_the_cheapest_designs_command_reruns_the_same_sweep_at_its_budget_and_seeds(tmp_path):
    from ccexp.compare.budget import design_command

    client = store(tmp_path)
    _, c = write_report(client, out_dir=tmp_path / "report")
    d = c.budgets.cheapest
    cmd = design_command(c.budgets, tmp_path / "sweep", ["+sweep=noise_pilot", "train.steps=100,200", "seed=0,1,2",
                                                         "data.path=x.jsonl"], "python")
    assert cmd == (f"python -m ccexp -m train.steps={d.steps} 'seed=range(0,{d.seeds_ci})' +sweep=noise_pilot "
                   f"data.path=x.jsonl hydra.sweep.dir={tmp_path / 'sweep'}")


def test_with_one_budget_the_report_says_what_a_second_would_add_instead_of_fitting(tmp_path):
    client = store(tmp_path, budgets=(100_000,), seeds=range(3))
    _, c = write_report(client, out_dir=tmp_path / "report")
    assert c.budgets.designs == [] and c.budgets.noise == {} and c.budgets.why_not == "one budget: no slope to fit"
    md = (tmp_path / "report" / "report.md").read_text()
    section = md.split("## Budget and seeds")[1].split("\n## ")[0]
    assert "No fit of noise against budget (one budget: no slope to fit)" in section
    assert "A second budget" in section and "+sweep=noise_pilot" in section and "(cheapest)" not in section


def test_two_budgets_fit_a_line_and_say_that_its_uncertainty_needs_a_third(tmp_path):
    client = store(tmp_path, budgets=BUDGETS[:2], seeds=range(4))
    _, c = write_report(client, out_dir=tmp_path / "report")
    fit = c.budgets.noise["uniform"]
    assert fit.points == 2 and fit.se is None and c.budgets.cheapest is not None
    md = (tmp_path / "report" / "report.md").read_text()
    assert "from 2 budgets: two points fix a line but not its uncertainty; a third budget would bound it" in md


def test_the_budget_study_pairs_by_seed_within_a_budget_only():
    from types import SimpleNamespace

    def run(sampler, seed, tokens, ppl):
        return SimpleNamespace(data=SimpleNamespace(metrics={"eval/ppl_macro": ppl, "train/tokens": tokens},
                                                    params={"seed": str(seed)}, tags={"sampler": sampler}))

    groups = {"random": [run("random", s, t, 100.0 + t / 1000) for s in range(2) for t in (1000, 2000)],
              "uniform": [run("uniform", s, t, 100.0 + t / 1000 + s) for s in range(2) for t in (1000, 2000)]}
    s = study(groups, "random", "eval/ppl_macro")
    by = {p.tokens: p for p in s.points}
    assert by[1000].effect == pytest.approx(0.5 / 101) and by[2000].effect == pytest.approx(0.5 / 102)
    assert by[1000].sd == pytest.approx(math.sqrt(0.5) / 101)  # differences 0 and 1 at 1,000 tokens, mean 101


def test_the_sweep_cost_comes_from_earlier_runs_of_the_same_model_on_the_same_device():
    from types import SimpleNamespace

    from ccexp.config import compose
    from ccexp.launch.sweep import sweep_cost
    from ccexp.tracking.mlflow_run import flatten

    configs = [compose(["debug=tiny", f"train.steps={s}"]) for s in (10, 20)]
    tokens = 30 * configs[0].train.tokens_per_step
    model = {f"model.{k}": v for k, v in flatten(configs[0].model).items()}

    def run(params, rate, total, train, embed):
        return SimpleNamespace(data=SimpleNamespace(params=params, metrics={
            "train/tokens_per_s": rate, "time/total_seconds": total, "time/train_seconds": train,
            "time/phase_embed_seconds": embed}))

    same = {**model, "trainer.accelerator": "cpu"}
    earlier = [run(same, 1000.0, 70.0, 20.0, 40.0), run(same, 3000.0, 30.0, 20.0, 0.0),  # medians 2000 tok/s, 10 s
               run({**model, "trainer.accelerator": "gpu"}, 1e6, 5.0, 1.0, 0.0),  # another device
               run({**model, "model.n_layer": "12", "trainer.accelerator": "cpu"}, 10.0, 5.0, 1.0, 0.0)]  # another model
    line = sweep_cost(configs, earlier)
    hours = (tokens / 2000.0 + 2 * 10.0) / 3600
    assert line == (f"sweep: 2 job(s), {tokens / 1e6:,.2f} M training tokens; at 2,000 tokens/s and 10 s outside "
                    f"training per run (the median of 2 earlier run(s) of this model here): about {hours * 3600:,.0f} "
                    "CPU-seconds, one job after another")
    assert "no earlier run of this model on this device" in sweep_cost(configs, earlier[2:])
    # a budget in passes is known once the corpus is tokenized; its train.max_steps caps it before that
    passes = [compose(["debug=tiny", "train.passes=1", f"train.max_steps={s}"]) for s in (10, 20)]
    hours = (tokens / 2000.0 + 2 * 10.0) / 3600
    assert sweep_cost(passes, earlier) == (
        f"sweep: 2 job(s), at most {tokens / 1e6:,.2f} M training tokens (train.passes, capped by train.max_steps); at "
        f"2,000 tokens/s and 10 s outside training per run (the median of 2 earlier run(s) of this model here): at "
        f"most {hours * 3600:,.0f} CPU-seconds, one job after another")
    uncapped = compose(["debug=tiny", "train.passes=1", "train.max_steps=null"])
    assert "train.passes sets the others' once the corpus is tokenized" in sweep_cost([configs[0], uncapped], earlier)


@pytest.mark.slow  # 12 tiny runs: about a minute
def test_the_noise_pilot_runs_end_to_end_and_its_design_is_in_the_report_and_in_mlflow(tmp_path):
    from conftest import run_ccexp

    out = tmp_path / "out"
    cases = __import__("pathlib").Path(__file__).parent / "cases"
    proc = run_ccexp("+sweep=noise_pilot", "debug=tiny", "data=jsonl", f"data.path={cases / 'round4.jsonl'}",
                     "data.label_fields=[domain]", "train.max_doc_tokens=64", "eval.max_tokens=63", "train.steps=10,20",
                     f"paths.outputs={out}", cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert log.index("sweep: 12 job(s), 0.09 M training tokens") < log.index("] - done: ")  # the cost, first
    assert "budget: noise of the paired difference ∝ budget^b: uniform b = " in log and "(2 budgets)" in log
    run_it = next(line for line in log.splitlines() if "  run it: " in line).split("  run it: ")[1]
    (report,) = out.glob("multirun/*/*/report/report.md")
    md = report.read_text()
    assert "## Budget and seeds: the cheapest design that decides" in md and "**(cheapest)**" in md
    assert run_it in md and f"hydra.sweep.dir={report.parent.parent}" in run_it
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp")
    (parent,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("ccexp.sweep") == "true"]
    assert run_it in parent.data.tags["mlflow.note.content"] and "cheapest design" in parent.data.tags["mlflow.note.content"]
    assert parent.data.tags["ccexp.cost"].startswith("sweep: 12 job(s)")
    assert "report/report.md" in [a.path for a in client.list_artifacts(parent.info.run_id, "report")]
