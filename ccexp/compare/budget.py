"""The cheapest experiment that decides: how the noise of a paired comparison falls with the token budget,
and the budget and number of seeds that decide it at the least cost.

A sweep that ran its samplers at two or more budgets (``train.steps`` or ``train.passes`` values), with two
or more paired seeds at each, measures at every budget B the paired differences d = sampler − baseline of the
primary metric (macro perplexity), as shares of the baseline's mean at B. Two stated models carry them to
other budgets:

- **noise**: SD(d)(B) = a · B^b, fitted by least squares in log–log (Heineman et al. 2025, "Signal and Noise",
  find noise falling with scale); with three or more budgets the slope b gets a standard error and a 95 %
  interval (Student's t, n − 2 degrees of freedom); two budgets fix the line but not its uncertainty, and
  one budget fixes nothing (the report then says what a second budget would add);
- **effect**: log(1 + mean(d))(B) = c + e · log2 B (a ratio to the baseline that changes by a factor per
  doubling, so it never passes −100 %), fitted the same way.

At each budget (the measured ones, and twice and four times the largest, marked as extrapolated) the design
is the paired seeds for a 95 % CI of ± ``min_effect`` ([`seeds_for_half_width`][ccexp.compare.stats.seeds_for_half_width]) and for
``power`` to detect the fitted effect ([`seeds_to_detect`][ccexp.compare.stats.seeds_to_detect]), the largest over the samplers; its
cost is seeds × samplers runs of B tokens at the throughput the sweep measured (each run's
``train/tokens_per_s``, plus its measured time outside training). The cheapest design is the one whose CI
runs cost least.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

import numpy as np

from ccexp.compare.stats import MAX_SEEDS, sample_sd, seeds_for_half_width, seeds_to_detect

BUDGET_KEYS = ("train.steps", "train.passes")  # the settings a budget sweep varies
EXTRAPOLATE = (2, 4)  # beyond the largest measured budget, by these factors (marked as extrapolated)


@dataclass
class Point:
    """One sampler against the baseline at one budget: ``tokens`` trained per run (int), the paired seeds ``n``,
    the baseline's mean of the metric, and the paired differences' mean and SD as shares of that mean."""

    tokens: int
    sampler: str
    n: int
    baseline_mean: float
    effect: float
    sd: float


@dataclass
class Fit:
    """``y = intercept + slope · x`` by least squares over ``points`` (x, y) pairs; ``se``: the slope's
    standard error (None with two points: a line through two points has no residual to judge it by)."""

    intercept: float
    slope: float
    se: float | None
    points: int

    @property
    def half(self) -> float | None:
        """Half-width of the slope's 95 % CI (Student's t, points − 2 degrees of freedom), None without ``se``."""
        from scipy import stats

        return None if self.se is None else float(stats.t.ppf(0.975, self.points - 2) * self.se)


def fit_line(x, y) -> Fit | None:
    """Least squares of float ``y`` on float ``x`` (equal lengths); None for fewer than two distinct x."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if np.unique(x).size < 2:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    se = None
    if x.size >= 3:
        resid = y - (intercept + slope * x)
        se = float(math.sqrt(resid @ resid / (x.size - 2) / ((x - x.mean()) @ (x - x.mean()))))
    return Fit(float(intercept), float(slope), se, int(x.size))


@dataclass
class Design:
    """One candidate budget: ``tokens`` per run, the noise and effect the models give there (shares), the paired
    seeds for the CI and for the power (None: no noise estimate), the runs, tokens and hours that costs."""

    tokens: int
    steps: int
    extrapolated: bool
    sd: float
    effect: float
    seeds_ci: int
    seeds_power: int
    runs: int
    hours: float
    hours_power: float = math.nan  # the runs for the power instead: seeds_power x samplers


@dataclass
class BudgetStudy:
    """What a sweep's budgets say: the points, the noise and effect fits per sampler, the designs and the
    cheapest; ``unit``: ``CPU`` or ``GPU`` hours; ``why_not``: why no fit was made (one budget, one seed)."""

    metric: str
    points: list[Point]
    noise: dict[str, Fit] = field(default_factory=dict)
    effect: dict[str, Fit] = field(default_factory=dict)
    designs: list[Design] = field(default_factory=list)
    unit: str = "CPU"
    why_not: str = ""
    min_effect: float = 0.02
    power: float = 0.8

    @property
    def cheapest(self) -> Design | None:
        """The design whose runs for the ± ``min_effect`` CI cost least (None: none within ``MAX_SEEDS``)."""
        ok = [d for d in self.designs if d.seeds_ci <= MAX_SEEDS]
        return min(ok, key=lambda d: d.hours) if ok else None

    @property
    def cheapest_power(self) -> Design | None:
        """The design whose runs for ``power`` at the fitted effect cost least."""
        ok = [d for d in self.designs if d.seeds_power <= MAX_SEEDS]
        return min(ok, key=lambda d: d.hours_power) if ok else None


def _budget(run) -> int | None:
    tokens = run.data.metrics.get("train/tokens")
    return int(round(tokens)) if tokens is not None and tokens > 0 else None


def budget_points(groups: dict[str, list], baseline: str, metric: str) -> list[Point]:
    """Every (budget, sampler) with two or more seeds paired with the baseline's runs of that budget.

    Args:
        groups: sampler -> its MLflow runs (of every budget); runs are paired by the ``seed`` param.
    """
    base: dict[tuple[int, str], float] = {}
    for r in groups.get(baseline, []):
        if _budget(r) is not None and metric in r.data.metrics:
            base[_budget(r), r.data.params.get("seed")] = r.data.metrics[metric]
    points = []
    for g, runs in groups.items():
        if g == baseline:
            continue
        by: dict[int, list[tuple[float, float]]] = {}
        for r in runs:
            key = (_budget(r), r.data.params.get("seed"))
            if key in base and metric in r.data.metrics:
                by.setdefault(key[0], []).append((r.data.metrics[metric], base[key]))
        for tokens, pairs in sorted(by.items()):
            if len(pairs) < 2:
                continue
            mine, theirs = np.array(pairs).T
            mean = float(theirs.mean())
            diffs = (mine - theirs) / mean
            points.append(Point(tokens, g, len(pairs), mean, float(diffs.mean()), sample_sd(diffs)))
    return points


STAGE_PHASES = ("time/phase_embed_seconds", "time/phase_corpus_tokenize_seconds")  # cached after a sweep's first job


def device_time(hours: float, unit: str = "CPU") -> str:
    """A duration of compute as a person reads it: ``84.6 CPU-hours`` from an hour on, ``12 CPU-minutes`` from a
    minute, else ``40 CPU-seconds`` (``unit``: CPU or GPU). A sweep's cost of 115 s read "0.0 CPU-hours"."""
    if hours >= 1:
        return f"{hours:,.1f} {unit}-hours"
    if hours * 60 >= 1:
        return f"{hours * 60:,.0f} {unit}-minutes"
    return f"{hours * 3600:,.0f} {unit}-seconds"


def throughput(runs: list) -> tuple[float, float]:
    """(training tokens per second, seconds per run outside training): medians over ``runs``' own
    ``train/tokens_per_s`` and ``time/total_seconds − time/train_seconds`` less the stages a sweep computes once
    (``STAGE_PHASES``: embedding, corpus and tokenizing)."""
    rates = [r.data.metrics["train/tokens_per_s"] for r in runs if r.data.metrics.get("train/tokens_per_s")]
    extra = [r.data.metrics["time/total_seconds"] - r.data.metrics["time/train_seconds"]
             - sum(r.data.metrics.get(k, 0.0) for k in STAGE_PHASES) for r in runs
             if "time/total_seconds" in r.data.metrics and "time/train_seconds" in r.data.metrics]
    return (float(np.median(rates)) if rates else math.nan), (float(np.median(extra)) if extra else 0.0)


def study(groups: dict[str, list], baseline: str, metric: str, min_effect: float = 0.02,
          power: float = 0.8) -> BudgetStudy:
    """The budget study of a sweep's runs (``groups``: sampler -> runs of every budget): the points, the fits
    and, with two or more budgets, the designs (see the module docstring)."""
    points = budget_points(groups, baseline, metric)
    runs = [r for rs in groups.values() for r in rs]
    gpu = any(str(r.data.params.get("trainer.accelerator", "cpu")) in ("gpu", "cuda") for r in runs)
    out = BudgetStudy(metric, points, unit="GPU" if gpu else "CPU", min_effect=min_effect, power=power)
    budgets = sorted({p.tokens for p in points})
    if len(budgets) < 2:
        out.why_not = ("one budget: no slope to fit" if budgets else "no budget with two paired seeds")
        return out
    for g in dict.fromkeys(p.sampler for p in points):
        mine = [p for p in points if p.sampler == g]
        if len(mine) >= 2 and all(p.sd > 0 for p in mine):
            out.noise[g] = fit_line(np.log([p.tokens for p in mine]), np.log([p.sd for p in mine]))
            out.effect[g] = fit_line(np.log2([p.tokens for p in mine]), np.log1p([p.effect for p in mine]))
    if out.noise:
        out.designs = designs(out, groups, budgets)
    return out


def designs(s: BudgetStudy, groups: dict[str, list], budgets: list[int]) -> list[Design]:
    """The candidate designs of study ``s``: the measured budgets and ``EXTRAPOLATE`` times the largest."""
    runs = [r for rs in groups.values() for r in rs]
    rate, extra = throughput(runs)
    per_step = {int(round(r.data.metrics["train/tokens"])) / max(1, int(r.data.params.get("train.steps", 1)))
                for r in runs if r.data.metrics.get("train/tokens") and r.data.params.get("train.steps")}
    tokens_per_step = max(per_step) if per_step else 1.0
    out = []
    for tokens in budgets + [budgets[-1] * f for f in EXTRAPOLATE]:
        seeds_ci, seeds_power, worst_sd, effect = 2, 2, 0.0, 0.0
        for g, fit in s.noise.items():
            sd = float(math.exp(fit.intercept + fit.slope * math.log(tokens)))
            eff = math.expm1(s.effect[g].intercept + s.effect[g].slope * math.log2(tokens))
            seeds_ci = max(seeds_ci, seeds_for_half_width(sd, s.min_effect))
            seeds_power = max(seeds_power, seeds_to_detect(eff, sd, power=s.power))
            if sd > worst_sd:
                worst_sd, effect = sd, eff
        per_run = (tokens / rate + extra) / 3600 if rate == rate else math.nan
        n_runs = seeds_ci * len(groups)
        out.append(Design(int(tokens), int(round(tokens / tokens_per_step)), tokens > budgets[-1], worst_sd, effect,
                          seeds_ci, seeds_power, n_runs, n_runs * per_run, seeds_power * len(groups) * per_run))
    return out


def _seeds(n: int) -> str:
    return f"> {MAX_SEEDS:,}" if n > MAX_SEEDS else f"{n:,}"


def budget_markdown(s: BudgetStudy, command: str | None) -> list[str]:
    """The report's section on budgets: the measured noise and effect, the fits with their uncertainty, the
    design table with the cheapest marked, and the command that runs it (or why there is no fit)."""
    md = ["## Budget and seeds: the cheapest design that decides", ""]
    measured = "; ".join(f"{p.sampler} at {p.tokens:,} tokens: SD of the paired difference {p.sd:.1%} over {p.n} "
                         "seeds" for p in s.points)
    if not s.designs and len({p.tokens for p in s.points}) < 2:
        return md + [f"No fit of noise against budget ({s.why_not})." + (f" Measured here: {measured}." if measured
                                                                         else "")
                     + " A second budget (this sweep again at twice or half its `train.steps`, with the same seeds) "
                     "would measure how that noise changes with the budget; the report would then name the budget and "
                     "the number of seeds that decide this comparison at the least cost. `+sweep=noise_pilot` is such "
                     "a pilot: 3 seeds at two budgets.", ""]
    if not s.designs:
        return md + [f"No fit of noise against budget: no sampler's paired differences vary at two budgets. "
                     f"Measured here: {measured}.", ""]
    md += [f"The paired difference against the baseline on {s.metric}, as a share of the baseline's mean, at each "
           "budget (tokens per run):", "", "| sampler | tokens | seeds | effect | SD of the differences |",
           "|---|---:|---:|---:|---:|"]
    md += [f"| {p.sampler} | {p.tokens:,} | {p.n} | {p.effect:+.2%} | {p.sd:.2%} |" for p in s.points]
    md += ["", "Fits (noise: SD ∝ budget^b in log–log; effect: the ratio to the baseline, 1 + effect, by a factor per "
           "doubling of the budget):", ""]
    for g, fit in s.noise.items():
        eff = s.effect[g]
        md.append(f"- {g}: b = {fit.slope:+.2f}" + (f" ± {fit.half:.2f} (95 % CI, {fit.points} budgets)" if fit.half
                                                    is not None else f" from {fit.points} budgets: two points fix a "
                                                    "line but not its uncertainty; a third budget would bound it")
                  + f"; 1 + effect × {math.exp(eff.slope):.3f} per doubling")
    cheap = s.cheapest
    md += ["", f"Designs: paired seeds for a 95 % CI of ± {s.min_effect:.0%} (`report.min_effect`) and for "
           f"{s.power:.0%} power at the fitted effect, the larger over the samplers; cost = seeds × "
           f"{s.designs[0].runs // max(1, s.designs[0].seeds_ci)} samplers runs at the throughput measured here "
           f"({s.unit}-hours: the runs one after another, at one run's measured tokens per second and time outside "
           "training).", "",
           f"| tokens per run | steps | SD (fitted) | effect (fitted) | seeds for ± {s.min_effect:.0%} | runs | "
           f"{s.unit}-hours | seeds for {s.power:.0%} power | {s.unit}-hours |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    power = s.cheapest_power
    for d in s.designs:
        mark = " **(cheapest)**" if d is cheap else " (extrapolated)" if d.extrapolated else ""
        md.append(f"| {d.tokens:,}{mark} | {d.steps:,} | {d.sd:.2%} | {d.effect:+.2%} | {_seeds(d.seeds_ci)} | "
                  f"{d.runs:,} | {d.hours:,.2f} | {_seeds(d.seeds_power)}{' **(cheapest)**' if d is power else ''} | "
                  f"{d.hours_power:,.2f} |")
    if power is not None and (cheap is None or power.hours_power < cheap.hours):
        md += ["", f"Resolving the effect fitted ({power.effect:+.1%} at {power.tokens:,} tokens) with {s.power:.0%} power "
               f"is cheaper: {power.seeds_power} seeds at {power.steps:,} steps, {power.hours_power:,.2f} {s.unit}-hours. "
               "The effect of a pilot's few seeds is itself uncertain, so that design is only as good as the effect; "
               f"the ± {s.min_effect:.0%} CI does not depend on it."]
    if command:
        md += ["", "The cheapest design, in this same sweep folder (finished jobs are kept):", "",
               f"```bash\n{command}\n```"]
    return md + [""]


def design_command(s: BudgetStudy, sweep_dir, task_overrides: list[str], python: str) -> str | None:
    """``python -m ccexp -m ... train.steps=<the cheapest design's> seed=range(0,<its seeds>)
    hydra.sweep.dir=<the same folder>``, or None without a design or a sweep folder."""
    d = s.cheapest
    if d is None or sweep_dir is None:
        return None
    keep = [o for o in task_overrides if not o.lstrip("+~").split("=")[0] in (*BUDGET_KEYS, "seed",
                                                                              "hydra.sweep.dir")]
    args = [f"train.steps={d.steps}", f"seed=range(0,{d.seeds_ci})" if d.seeds_ci > 2 else "seed=0,1", *keep,
            f"hydra.sweep.dir={sweep_dir}"]
    return f"{python} -m ccexp -m " + " ".join(shlex.quote(a) for a in args)


def budget_lines(s: BudgetStudy, command: str | None) -> list[str]:
    """A few lines for the end of a sweep: the noise exponent and the cheapest design, or nothing to say."""
    if not s.designs:
        return []
    cheap = s.cheapest
    fits = ", ".join(f"{g} b = {f.slope:+.2f}" + (f" ± {f.half:.2f}" if f.half is not None else " (2 budgets)")
                     for g, f in s.noise.items())
    out = [f"budget: noise of the paired difference ∝ budget^b: {fits}"]
    if cheap is not None:
        out.append(f"  cheapest design for ± {s.min_effect:.0%}: {cheap.seeds_ci} seeds x {cheap.tokens:,} tokens "
                   f"({cheap.steps:,} steps), {cheap.runs} runs, {cheap.hours:,.2f} {s.unit}-hours"
                   + (" (extrapolated)" if cheap.extrapolated else ""))
    power = s.cheapest_power
    if power is not None:
        out.append(f"  cheapest for {s.power:.0%} power at the fitted effect ({power.effect:+.1%}): {power.seeds_power} "
                   f"seeds x {power.tokens:,} tokens ({power.steps:,} steps), {power.hours_power:,.2f} {s.unit}-hours"
                   + (" (extrapolated)" if power.extrapolated else ""))
    if command:
        out.append(f"  run it: {command}")
    return out
