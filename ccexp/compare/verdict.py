"""The verdict of a comparison: for every sampler and headline metric, better / worse / unresolved
against the baseline (the paired difference and its 95 % confidence interval), the signal and noise
of each metric, how many seeds would decide it, and the command that adds them to the same sweep.

[`verdict_rows`][ccexp.compare.verdict.verdict_rows] computes it from a `Comparison`;
[`verdict_markdown`][ccexp.compare.verdict.verdict_markdown] is the report's first section and [`verdict_lines`][ccexp.compare.verdict.verdict_lines] the few lines a sweep
prints when it ends. The statistics are [`ccexp.compare.stats`][ccexp.compare.stats].
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from ccexp.compare.stats import (MAX_SEEDS, family_level, fcr_level, fdr_decisions, mean_ci, paired_p, sample_sd,
                                  seeds_for_half_width, seeds_to_detect, signal_and_noise, verdict)

# the metrics a verdict is given for, in this order (then every per-label perplexity), with their names
HEADLINE_NAMES = {"eval/bpb": "bits per byte", "eval/ppl": "overall ppl", "eval/ppl_macro": "macro ppl (clusters equal)",
                  "eval/ppl_worst": "worst-cluster ppl", "eval/ppl_rare": "rarest-quintile ppl",
                  "eval/ppl_common": "commonest-quintile ppl", "eval/bpb_macro": "macro bits per byte"}
PRIMARY = "eval/bpb"
"""The question a comparison answers: bits per byte over every held-out document as it comes (no cluster weighted
up), the field's measure for data decisions (DataDecide, Paloma, Olmix: docs/comparisons.md). The verdict decides
it for each sampler against the baseline (Bonferroni over the samplers); the extension command sizes the sweep for
it. Runs without it (no scored bytes) are decided on overall perplexity."""
FAVOURS_BALANCING = ("eval/ppl_macro", "eval/bpb_macro", "eval/ppl_worst", "eval/ppl_rare", "eval/ppl_common")
"""Metrics averaged over (or picked among) ccexp's clusters, the clusters uniform and ClusterClip sample equally: a
policy that balances clusters is judged by a metric that balances them, so they favour balancing by construction
(marin-community/marin #6491). Reported as secondary, marked, never primary."""
LEVEL = 0.95  # the primary question's confidence (split over the samplers); the secondaries' false discovery rate 5 %
PLAN_TAG = "ccexp.comparison_plan"
"""The MLflow tag a sweep sets on its parent run before its first job: its comparison plan
([`comparison_plan`][ccexp.compare.verdict.comparison_plan]), JSON. The report reads it; a report asked another
primary metric says "post hoc" beside it."""


def check_primary(metric: str) -> None:
    """Refuse a primary metric that is not a held-out or lm-eval metric name, or one that favours balancing.

    Raises:
        CcexpError: one line naming the setting and what to use.
    """
    from ccexp.errors import CcexpError

    if not isinstance(metric, str) or not metric.startswith(("eval/", "lm_eval/")):
        raise CcexpError(f"report.primary={metric!r} is not a metric a run scores; use a held-out metric such as "
                         f"{PRIMARY} (bits per byte) or eval/ppl, or an lm-eval one (lm_eval/<task>/<metric>)")
    if metric in FAVOURS_BALANCING:
        raise CcexpError(f"report.primary={metric} averages over (or picks among) the clusters the samplers balance, "
                         f"so it favours balancing by construction and cannot be the question; use {PRIMARY} (bits per "
                         "byte over every held-out document) or eval/ppl; it is still reported, as exploratory")


def comparison_plan(config) -> dict:
    """The question a sweep asks, fixed before its first job: ``{"primary", "baseline", "min_effect", "power",
    "level", "seeds", "budget", "recorded"}`` from the sweep's composed ``config`` (``seeds``: the sweep's ``seed``
    values as given; ``budget``: train.steps, train.passes, train.tokens_per_step; ``recorded``: ISO time, UTC)."""
    import time

    from omegaconf import OmegaConf

    params = dict(OmegaConf.select(config, "hydra.sweeper.params", default=None) or {})
    task = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=None) or []]
    seeds = params.get("seed") or next((o.split("=", 1)[1] for o in task if o.lstrip("+~").startswith("seed=")),
                                       str(config.seed))
    return {"primary": str(config.report.primary), "baseline": str(config.report.baseline),
            "min_effect": float(config.report.min_effect), "power": float(config.report.power), "level": LEVEL,
            "seeds": str(seeds), "budget": {k: OmegaConf.select(config, f"train.{k}", default=None)
                                            for k in ("steps", "passes", "tokens_per_step")},
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
FEW_HELDOUT_DOCS = 20
"""A label value's perplexity on fewer held-out documents than this (``data.heldout_min_per_value``'s default) is
marked too few to read: a handful of documents is a handful of samples, whatever the tokens."""
MOVING_TAIL = 0.2  # a held-out curve still moving over this last share of the tokens trained is named (still_moving)


@dataclass
class Row:
    """One sampler against the baseline on one metric. ``mean``/``half``: the paired difference and the
    half-width of its confidence interval at ``level`` (metric units); ``rel_*``: the same as shares of the
    baseline's mean over the pairs; ``sd``: the differences' standard deviation; ``seeds_*``: seeds for 80 % power
    to resolve the observed difference / to detect ``min_effect`` of the baseline, and for a CI of ``± min_effect``
    (None where there is no estimate of ``sd`` yet); ``primary``: the row answers the comparison's question;
    ``p``: the paired t-test's two-sided p-value (NaN for one pair)."""

    metric: str
    sampler: str
    n: int
    baseline_mean: float
    mean: float
    half: float
    sd: float
    verdict: str
    seeds_observed: int | None
    seeds_min_effect: int | None
    seeds_half_width: int | None
    primary: bool = False
    level: float = LEVEL
    p: float = math.nan

    @property
    def rel_mean(self) -> float:
        return self.mean / self.baseline_mean if self.baseline_mean else math.nan

    @property
    def rel_half(self) -> float:
        return self.half / self.baseline_mean if self.baseline_mean else math.nan


def verdict_metrics(metrics: list[str]) -> list[str]:
    """The headline metrics present, then the per-label perplexities (``eval/ppl_<label>/<value>``)."""
    labels = sorted(m for m in metrics if m.startswith("eval/ppl_") and "/" in m[len("eval/"):]
                    and not m.startswith("eval/ppl_cluster/"))
    return [m for m in HEADLINE_NAMES if m in metrics] + labels


def verdict_rows(comparison, min_effect: float = 0.02, power: float = 0.8) -> list[Row]:
    """Every (metric, sampler) of [`verdict_metrics`][ccexp.compare.verdict.verdict_metrics] with a paired difference
    against the baseline. One question is decided: the comparison's ``primary`` (by default
    [`PRIMARY`][ccexp.compare.verdict.PRIMARY]; overall ppl where no run has it),
    each sampler at the level [`family_level`][ccexp.compare.stats.family_level] keeps for all of them together.
    Every other row is exploratory: called by Benjamini-Hochberg at a 5 % false discovery rate over all of them
    ([`fdr_decisions`][ccexp.compare.stats.fdr_decisions]), its interval at the level
    [`fcr_level`][ccexp.compare.stats.fcr_level] gives (it excludes 0 exactly where the row is called)."""
    pairs = [(m, g, d) for m in verdict_metrics(comparison.metrics) for g, d in comparison.paired.get(m, {}).items()]
    same = {g for _, g, _ in pairs if comparison.identical_to_baseline(g)}
    present = {m for m, _, _ in pairs}
    question = next((m for m in (getattr(comparison, "primary", PRIMARY), PRIMARY) if m in present), "eval/ppl")
    asked = [(m, g, d) for m, g, d in pairs if m == question and g not in same]
    others = [(m, g, d) for m, g, d in pairs if m != question and g not in same]
    primary_level = family_level(LEVEL, max(1, len(asked)))
    p = {(m, g): float(paired_p([d["diffs"]])[0]) for m, g, d in pairs}
    called = dict(zip([(m, g) for m, g, _ in others], fdr_decisions([p[m, g] for m, g, _ in others], 1 - LEVEL)))
    known = sum(1 for m, g, _ in others if not math.isnan(p[m, g]))
    secondary_level = fcr_level(1 - LEVEL, sum(called.values()), known) if known else LEVEL
    rows = []
    for m, g, d in pairs:
        level = primary_level if m == question else secondary_level
        diffs, base = d["diffs"], d["baseline_mean"]
        mean, half = mean_ci(diffs, level)
        sd = sample_sd(diffs) if len(diffs) >= 2 else math.nan
        lower = not m.startswith("lm_eval/") or m.endswith("perplexity")
        word = verdict(mean, half, lower_is_better=lower)
        if g in same:
            word = "identical stream"
        elif m != question and word != "unresolved" and not called[m, g]:  # rounding at the edge: BH decides
            word = "unresolved"
        known_sd = not math.isnan(sd)
        alpha = 1 - level if m == question else 1 - LEVEL
        rows.append(Row(m, g, len(diffs), base, mean, half, sd, word,
                        seeds_to_detect(mean, sd, alpha=alpha, power=power) if known_sd else None,
                        seeds_to_detect(min_effect * abs(base), sd, alpha=alpha, power=power)
                        if known_sd and base else None,
                        seeds_for_half_width(sd, min_effect * abs(base), level) if known_sd and base else None,
                        primary=m == question, level=level, p=p[m, g]))
    return rows


def not_scored(comparison) -> list[str]:
    """Lines naming every label value the verdict cannot score (no held-out document in any run), so none is
    dropped without a word; [] when every value was scored."""
    gone = [m for m in verdict_metrics(comparison.metrics) if m not in HEADLINE_NAMES
            and all(comparison.no_documents(m, g) for g in comparison.groups)]
    if not gone:
        return []
    return ["", "Not scored (no held-out document of the value in any run, so no perplexity): "
            + "; ".join(metric_name(m) for m in gone) + ". With `data.heldout_stratify=<label>` every value keeps up "
            "to `data.heldout_min_per_value` held-out documents (at most half of its documents); a value with one "
            "document cannot be held out."]


def moving_note(comparison) -> list[str]:
    """A paragraph when held-out perplexity was still moving at the end of training
    (`ccexp.compare.report.still_moving`): the verdict is of where training stopped."""
    moving = getattr(comparison, "moving", {})
    if not moving:
        return []
    parts = [f"{g} {change:+.0%} ({a / 1e6:.2f}M → {b / 1e6:.2f}M tokens)" for g, (change, a, b) in moving.items()]
    rising = [g for g, (change, _, _) in moving.items() if change > 0]
    return ["", f"**Held-out perplexity was still moving when training stopped** (macro ppl of the held-out curve, "
            f"mean over seeds, from its last point at or before {1 - MOVING_TAIL:.0%} of the tokens trained to the "
            "end): " + "; ".join(parts) + ". The verdict "
            "is of the point where training stopped; at another `train.steps` the samplers may order differently "
            "(`curves.png`)." + (f" Rising ({', '.join(rising)}): the last tokens trained made held-out text less "
                                 "likely." if rising else "")]


def next_seed(comparison, command: str | None) -> list[str]:
    """What a one-seed comparison says in place of the seeds-needed table: why there is no verdict yet, the
    command that adds a second seed to the same sweep, and the decision sweep."""
    cost = comparison.extension_cost() if command and hasattr(comparison, "extension_cost") else None
    how = (f"Add a second seed to this same sweep (finished jobs and cached stages are reused"
           + (f"; {cost}" if cost else "") + f"):\n\n```bash\n{command}\n```"
           if command else "Run every sampler again with `seed=1` (the same data and settings).")
    return ["", "### Next: a second seed", "",
            "One seed per sampler: each difference above is a single pair, with no interval and no measure of "
            "seed-to-seed noise, so none of them is a verdict yet (an unresolved row may be all noise, a large one "
            "too). With two seeds this section gives the noise and the seeds a decision needs. " + how, "",
            "The decision study is `+sweep=sampler_seeds` (random, uniform and ClusterClip × 3 seeds, with lm-eval; "
            "docs/comparisons.md): its report sizes the seeds that decide your corpus's comparison."]


def metric_name(m: str) -> str:
    """A metric as the verdict names it: ``overall ppl``, ``ppl of domain = code.go``, ..."""
    if m in HEADLINE_NAMES:
        return HEADLINE_NAMES[m]
    head, _, value = m.rpartition("/")
    if head.startswith("eval/ppl_"):
        return f"ppl of {head[len('eval/ppl_'):]} = {value}"
    return m


def scored_name(comparison, m: str) -> str:
    """[`metric_name`][ccexp.compare.verdict.metric_name], and for a label value the held-out documents it is scored
    on (the fewest over runs), marked "too few to read" under [`FEW_HELDOUT_DOCS`][ccexp.compare.verdict.FEW_HELDOUT_DOCS]."""
    n = comparison.heldout_documents(m) if hasattr(comparison, "heldout_documents") else None
    if n is None or n == 0:
        return metric_name(m)
    return f"{metric_name(m)} ({n:,} held-out doc{'s' if n != 1 else ''}{': too few to read' if n < FEW_HELDOUT_DOCS else ''})"


def few_documents(comparison) -> list[str]:
    """A paragraph naming the label values scored on fewer than [`FEW_HELDOUT_DOCS`][ccexp.compare.verdict.FEW_HELDOUT_DOCS]
    held-out documents, and how to give them more; [] when there are none."""
    few = [(m, n) for m in verdict_metrics(comparison.metrics) if m not in HEADLINE_NAMES
           and (n := comparison.heldout_documents(m) if hasattr(comparison, "heldout_documents") else None)
           and n < FEW_HELDOUT_DOCS]
    if not few:
        return []
    return ["", f"Scored on fewer than {FEW_HELDOUT_DOCS} held-out documents, too few to read a difference from: "
            + "; ".join(f"{metric_name(m)} ({n})" for m, n in few) + ". The hash split holds out about "
            "`data.heldout_fraction` of each value; `data.heldout_stratify=<label>` gives every value up to "
            "`data.heldout_min_per_value` held-out documents (at most half of its documents)."]


def _alpha(rows: list[Row]) -> str:
    """The seeds-needed test's level in words: the question's share of 5 % where it is split over samplers."""
    level = next((r.level for r in rows if r.primary and r.verdict != "identical stream"), LEVEL)
    return "0.05" if level >= LEVEL else f"{1 - level:.3g} for the question (0.05 split over the samplers), 0.05 for the rest"


def _seeds(n: int | None) -> str:
    return "n/a (needs 2 seeds)" if n is None else f"> {MAX_SEEDS:,}" if n > MAX_SEEDS else f"{n:,}"


def _diff(r: Row) -> str:
    if math.isnan(r.half):
        return f"{r.rel_mean:+.1%} ({r.mean:+.4g}, 1 pair: no interval)"
    return f"{r.rel_mean:+.1%} ± {r.rel_half:.1%} ({r.mean:+.4g} ± {r.half:.2g}, n={r.n})"


def verdict_markdown(comparison, rows: list[Row], min_effect: float, power: float, command: str | None) -> list[str]:
    """The report's first section: the verdict table, signal and noise, seeds needed, the command."""
    base = comparison.baseline
    samplers = [g for g in comparison.others if any(r.sampler == g for r in rows)]
    if not rows:
        return [f"## Verdict against {base}", "", "No sampler has a run paired with the baseline's (same seed): "
                f"nothing to decide. Run {base} and the other samplers with the same seeds.", *not_scored(comparison),
                ""]
    by = {(r.metric, r.sampler): r for r in rows}
    metrics = list(dict.fromkeys(r.metric for r in sorted(rows, key=lambda r: not r.primary)))
    md = [f"## Verdict against {base}", "", f"{comparison.budget} Each sampler is paired with {base} seed by seed "
          "(same initialisation and data clustering). Differences are shown as a share of "
          f"{base}'s mean, then in the metric's units; lower is better for perplexity and bits per byte.", "",
          *question_paragraph(rows, base, comparison), "",
          f"| metric | {base} | " + " | ".join(f"{g} − {base}" for g in samplers) + " |",
          "|---|---:|" + "---|" * len(samplers)]
    for m in metrics:
        first = next(r for r in rows if r.metric == m)
        cells = [f"**{by[m, g].verdict}** {_diff(by[m, g])}" if (m, g) in by else "—" for g in samplers]
        name = (f"**{scored_name(comparison, m)}: the question**" if first.primary else
                scored_name(comparison, m) + (" †" if m in FAVOURS_BALANCING else ""))
        md.append(f"| {name} | {first.baseline_mean:.4g} | " + " | ".join(cells) + " |")
    md += not_scored(comparison) + few_documents(comparison) + moving_note(comparison)
    if all(r.n < 2 for r in rows):  # one seed: a section of n/a would say nothing; say what comes next
        return md + next_seed(comparison, command) + [""]
    md += ["", "### Signal, noise and seeds needed", "",
           "Noise: the seed-to-seed standard deviation within a sampler, pooled; signal: the spread between the "
           "samplers' means (Heineman et al. 2025, \"Signal and Noise\"); both as a share of the mean. Seeds needed "
           f"(paired two-sided t-test, α = {_alpha(rows)}, power {power:.0%}): to resolve the difference observed, to detect a "
           f"difference of {min_effect:.0%} of {base}'s mean (`report.min_effect`), and for a confidence interval "
           f"of ± {min_effect:.0%}. These are the seeds that resolve a difference in {power:.0%} of sweeps; a difference "
           "already resolved by fewer seeds was resolved with some luck.", "",
           "| metric | noise | signal | signal / noise | " + " | ".join(
               f"{g}: seeds now / to resolve observed / to detect {min_effect:.0%} / for ± {min_effect:.0%}"
               for g in samplers) + " |", "|---|---:|---:|---:|" + "---|" * len(samplers)]
    for m in metrics:
        sn = signal_and_noise({g: [r.data.metrics[m] for r in rs if m in r.data.metrics]
                               for g, rs in comparison.groups.items()})
        cells = [f"{by[m, g].n} / {_seeds(by[m, g].seeds_observed)} / {_seeds(by[m, g].seeds_min_effect)} / "
                 f"{_seeds(by[m, g].seeds_half_width)}" if (m, g) in by else "—" for g in samplers]
        noise, snr = ((f"{sn['noise_rel']:.1%}", f"{sn['snr']:.2f}") if math.isfinite(sn["noise_rel"])
                      else ("n/a (needs 2 seeds)", "n/a"))  # one seed per sampler: no spread to measure
        md.append(f"| {scored_name(comparison, m)} | {noise} | {sn['signal_rel']:.1%} | {snr} | "
                  + " | ".join(cells) + " |")
    cheaper = cheaper_metric(rows)
    if cheaper:
        md += ["", cheaper[0].upper() + cheaper[1:] + "."]
    if command:
        cost = comparison.extension_cost() if hasattr(comparison, "extension_cost") else None
        question = next((r.metric for r in rows if r.primary), getattr(comparison, "primary", PRIMARY))
        md += ["", f"To add the seeds that {metric_name(question)} needs to detect {min_effect:.0%} to this same "
               "sweep (finished jobs and cached stages are reused, failed jobs rerun)" + (f"; {cost}" if cost else "")
               + ":", "", f"```bash\n{command}\n```"]
    return md + [""]


def plan_words(comparison) -> str:
    """Where the question came from: the sweep's plan recorded before its runs, "post hoc" when the report asks
    another, or no plan (runs compared outside a sweep that recorded one)."""
    plan = getattr(comparison, "plan", None)
    if plan is None:
        return ("No comparison plan was recorded before these runs (not one sweep, or a sweep launched before plans "
                "were recorded): the question is the report's.")
    fixed = (f"the sweep's plan, recorded on its parent run at {plan.get('recorded', '?')} before its first job: "
             f"{metric_name(plan.get('primary', '?'))} against {plan.get('baseline', '?')}, minimum effect "
             f"{float(plan.get('min_effect', math.nan)):.0%}, seeds {plan.get('seeds', '?')}")
    if getattr(comparison, "post_hoc", False):
        return (f"**Post hoc:** this report decides {metric_name(comparison.primary)}, chosen after the runs; "
                f"{fixed}. A question picked after seeing the data is a forking path: read it as exploratory.")
    return f"Fixed before the runs: {fixed}."


def question_paragraph(rows: list[Row], base: str, comparison=None) -> list[str]:
    """What the verdict decides and at what level: the primary question (Bonferroni over the samplers) and where it
    was fixed, then the exploratory rows (Benjamini-Hochberg) and the mark on metrics that favour balancing."""
    primary = _primary_rows(rows)
    asked = [r for r in primary if r.verdict != "identical stream"]
    level = asked[0].level if asked else LEVEL
    name = metric_name(primary[0].metric) if primary else "none"
    others = [r for r in rows if not r.primary and r.verdict != "identical stream"]
    split = (f" (split over the {len(asked)} samplers, Bonferroni: each interval at {level:.1%})"
             if len(asked) > 1 else "")
    natural = (" over every held-out document as it comes, no cluster weighted up"
               if primary and primary[0].metric in ("eval/bpb", "eval/ppl") else "")
    text = [f"**The question: {name}**{natural}. Each sampler "
            f"is *better* or *worse* than {base} when the confidence interval of the paired difference (Student's t "
            f"over the seeds) excludes 0, else *unresolved*; the chance of calling any sampler better or worse when "
            f"none differs is at most {1 - LEVEL:.0%}{split}."]
    wanted = getattr(comparison, "primary", None)
    if primary and wanted is not None and primary[0].metric != wanted:
        text.append(f"**No run scored {metric_name(wanted)}**, the question asked: this verdict decides {name} "
                    "instead, which is not the question asked.")
    if comparison is not None:
        text.append(plan_words(comparison))
    if others:
        level2 = others[0].level
        text.append(f"Every other row is **exploratory**: {len(others)} comparisons, called by Benjamini-Hochberg at a "
                    f"{1 - LEVEL:.0%} false discovery rate, each interval at {level2:.2%} (Benjamini & Yekutieli 2005: "
                    "it excludes 0 exactly where the row is called). Read them as leads for the next sweep's question, "
                    "not as findings. † averages over (or picks among) the clusters the samplers balance, so it "
                    "favours balancing by construction.")
    return [" ".join(text)]


def cheaper_metric(rows: list[Row]) -> str | None:
    """A sentence naming the headline metric whose decision needs the fewest seeds, when it needs at most half of
    what the primary metric needs (seeds to detect ``min_effect``, the most over samplers); None otherwise. A metric
    chosen after seeing the data is a forking path: the sentence says to choose it before the next sweep."""
    need: dict[str, int] = {}
    for r in rows:
        if r.metric in HEADLINE_NAMES and r.seeds_min_effect is not None and r.verdict != "identical stream":
            need[r.metric] = max(need.get(r.metric, 0), min(r.seeds_min_effect, MAX_SEEDS))
    question = next((r.metric for r in rows if r.primary), None)
    if question not in need or len(need) < 2:
        return None
    best = min((m for m in need if m != question and m not in FAVOURS_BALANCING), key=lambda m: need[m], default=None)
    if best is None or need[best] * 2 > need[question]:
        return None
    return (f"{HEADLINE_NAMES[best]} needs about {need[best]:,} seeds to detect the same share where "
            f"{metric_name(question)} needs {need[question]:,}: if it is the question you ask, decide that before "
            "the next sweep (a metric picked after seeing the data is a forking path)")


def seeds_wanted(rows: list[Row]) -> int | None:
    """The seeds the primary metric needs: the most over samplers for detecting ``min_effect`` (None
    without an estimate)."""
    wanted = [r.seeds_min_effect for r in rows if r.primary and r.seeds_min_effect is not None
              and r.verdict != "identical stream"]
    return min(max(wanted), MAX_SEEDS) if wanted else None


def extend_command(sweep_dir: Path | None, task_overrides: list[str], seeds: list[str], wanted: int | None) -> str | None:
    """``python -m ccexp -m ... seed=<the seeds so far and new ones> hydra.sweep.dir=<the same folder>``, or
    None when there is no sweep folder, no estimate, or the sweep has the seeds already."""
    if sweep_dir is None or wanted is None or len(seeds) >= wanted:
        return None
    have = sorted({int(s) for s in seeds if str(s).lstrip("-").isdigit()})
    new = have + [s for s in range(max(have, default=-1) + 1, max(have, default=-1) + 1 + wanted) if s not in have]
    new = new[:wanted]
    contiguous = len(new) > 10 and new == list(range(new[0], new[-1] + 1))
    seed = f"seed=range({new[0]},{new[-1] + 1})" if contiguous else f"seed={','.join(map(str, new))}"  # Hydra's sweep range
    args = [seed if o.lstrip("+~").startswith("seed=") else o for o in task_overrides
            if not o.lstrip("+~").startswith("hydra.sweep.dir=")]  # seed keeps its place: outermost stays outermost
    args = (args if seed in args else args + [seed]) + [f"hydra.sweep.dir={sweep_dir}"]
    return f"{python_command()} -m ccexp -m " + " ".join(shlex.quote(a) for a in args)


def python_command() -> str:
    """The interpreter that runs ccexp, as a command can name it: ``.venv/bin/python`` under the working
    folder, else its absolute path (a bare ``python`` may be another one, without ccexp)."""
    import os
    import sys

    rel = os.path.relpath(sys.executable)
    return rel if not rel.startswith("..") else sys.executable


VERDICT_TAG = "verdict"
"""The MLflow tag a sweep sets on each of its runs: its sampler's verdict on the primary metric in one line
([`arm_verdicts`][ccexp.compare.verdict.arm_verdicts]); the view ``python -m ccexp.ui`` opens groups the runs by it,
so each group's row starts with the verdict."""


def _primary_rows(rows: list[Row]) -> list[Row]:
    """The rows of the comparison's question ([`PRIMARY`][ccexp.compare.verdict.PRIMARY], else overall ppl)."""
    return [r for r in rows if r.primary]


def arm_verdicts(comparison, rows: list[Row]) -> dict[str, str]:
    """Per sampler, its verdict on the primary metric in one line, as the MLflow view's group rows show it
    ([`VERDICT_TAG`][ccexp.compare.verdict.VERDICT_TAG]): ``uniform: unresolved on bits per byte, +6.6% ± 280.0% vs
    random (2 seeds)``; the baseline's ``random: the baseline``. ``{}`` when no sampler is paired with the
    baseline."""
    primary = _primary_rows(rows)
    if not primary:
        return {}
    short = {"eval/bpb": "bits per byte", "eval/ppl": "ppl"}  # else metric_name's
    out = {comparison.baseline: f"{comparison.baseline}: the baseline"}
    for r in primary:
        spread = "1 pair, no interval" if math.isnan(r.half) else f"± {r.rel_half:.1%}"
        out[r.sampler] = (f"{r.sampler}: {r.verdict} on {short.get(r.metric, metric_name(r.metric))}, {r.rel_mean:+.1%} {spread} vs "
                          f"{comparison.baseline} ({r.n} seed{'s' if r.n != 1 else ''})")
    return out


def verdict_lines(comparison, rows: list[Row], command: str | None) -> list[str]:
    """A few lines for the end of a sweep: the primary metric's verdict per sampler and the command."""
    primary = _primary_rows(rows)
    if not primary:
        return [f"verdict against {comparison.baseline}: nothing to decide (no sampler has a run paired with "
                f"{comparison.baseline}'s by seed); run {comparison.baseline} and the other samplers with the same seeds"]
    wanted = getattr(comparison, "primary", primary[0].metric)
    name = metric_name(primary[0].metric) + (
        f" (no run scored {metric_name(wanted)}, the question asked)" if wanted != primary[0].metric else
        " (post hoc: not the sweep's planned question)" if getattr(comparison, "post_hoc", False) else "")
    seeds = max(r.n for r in primary)
    out = [f"verdict against {comparison.baseline} on {name} ({seeds} paired seed(s)):"]
    for r in primary:
        need = "" if r.verdict in ("better", "worse", "identical stream") or not r.seeds_observed else \
            f"; about {_seeds(r.seeds_observed)} seeds would resolve it" if r.seeds_observed > r.n else \
            (f"; not resolved by these {r.n} seeds, though a difference this size is resolved by about "
             f"{_seeds(r.seeds_observed)} in {comparison.power:.0%} of sweeps (noise measured on few seeds is rough): "
             "more seeds decide it")
        out.append(f"  {r.sampler}: {r.verdict}, {_diff(r)}{need}")
    moving = getattr(comparison, "moving", {})
    if moving:
        out.append("  held-out ppl was still moving when training stopped (" + ", ".join(
            f"{g} {change:+.0%} from {a / 1e6:.2f}M to {b / 1e6:.2f}M tokens" for g, (change, a, b) in moving.items())
            + "): the verdict depends on where training stopped")
    designed = getattr(getattr(comparison, "budgets", None), "designs", None)
    cost = comparison.extension_cost() if command and hasattr(comparison, "extension_cost") else None
    priced = f" ({cost})" if cost else ""
    if command and seeds < 2:
        out.append(f"  one seed decides nothing; add a second{priced}: {command}")
    elif command and not designed:  # with budgets, the budget lines' design is the next step
        out.append(f"  add the seeds that detect {comparison.min_effect:.0%} (report.min_effect){priced}: {command}")
    cheaper = cheaper_metric(rows)
    if cheaper and seeds >= 2:
        out.append(f"  {cheaper}")
    if getattr(comparison, "budgets", None) is not None:
        from ccexp.compare.budget import budget_lines

        out += budget_lines(comparison.budgets, comparison.budget_command())
    return out
