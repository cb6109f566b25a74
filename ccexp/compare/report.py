"""Comparison report across runs: ``python -m ccexp.report``.

Reads the runs of a sweep (the children of an MLflow parent run; by default the latest sweep) or of
a whole experiment from the MLflow store, groups them by sampler and leads with the **verdict**
([`ccexp.compare.verdict`][ccexp.compare.verdict]): against a baseline sampler (``--baseline``, default ``random`` when
present), every other sampler's *paired* difference on each headline metric, run by run with the
same seed, with its 95 % confidence interval (Student's t over the pairs) and the word it earns —
better, worse or unresolved — then signal and noise, the seeds a decision needs, and the command
that adds them to the same sweep. Pairing by seed removes the variance the samplers share (the same
initialisation, and by default the same clustering), so it detects smaller effects than comparing
two means. Then the mean over seeds ± 95 % CI of every held-out and lm-eval metric per sampler, the
per-cluster metrics (left out when the runs were clustered differently), and the runs' cost. The
report states whether every run trained on the same number of tokens.
Files: ``report.md``, ``report.html`` (the same, rendered), ``comparison.csv``, ``paired.csv`` and
``comparison.png`` (the headline metrics as bars with CI whiskers).

Usage:
    python -m ccexp.report                                   # latest sweep in outputs/mlflow.db
    python -m ccexp.report --parent <run id> --out reports/x --baseline uniform --min-effect 0.01
    python -m ccexp.report --all-runs --experiment ccexp
    python -m ccexp.report --tracking-uri http://mlflow.example:5000  # a team's server (or MLFLOW_TRACKING_URI)
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ccexp.errors import CcexpError
from ccexp.names import NOT_COMPUTED
from ccexp.compare.budget import BUDGET_KEYS
from ccexp.compare.stats import mean_ci
from ccexp.compare.verdict import FAVOURS_BALANCING, PLAN_TAG, PRIMARY, check_primary, metric_name

HEADLINE = ["eval/ppl", "eval/ppl_macro", "eval/ppl_worst", "eval/ppl_rare", "eval/ppl_common", "eval/bpb",
            "eval/bpb_macro"]
_PATTERNS = [r"eval/ppl(_macro|_worst|_rare|_common)?$", r"eval/bpb(_macro)?$", r"eval/ppl_[a-z_]+/.+",
             r"lm_eval/.+/(acc|acc_norm)$", r"lm_eval/.+/word_perplexity$"]
# what a run cost: depends on the machine and what else ran on it, so it is kept apart from quality
_COST = [r"train/tokens_per_s$", r"time/train_seconds$", r"time/total_seconds$"]


def paired_differences(groups: dict[str, list], baseline: str, metrics: list[str]) -> dict[str, dict[str, dict]]:
    """Per metric and sampler: runs paired with the baseline's run of the same seed.

    Returns:
        ``{metric: {sampler: {"mean", "half", "n", "significant", "diffs", "seeds", "baseline_mean"}}}`` with
        ``mean`` the mean of (sampler − baseline) over the pairs, ``half`` the half-width of its 95 %
        confidence interval (Student's t, n−1 degrees of freedom; NaN for n < 2), ``significant`` true
        where the interval excludes 0, ``diffs`` the differences seed by seed (of ``seeds``) and ``baseline_mean`` the
        baseline's mean over the paired seeds. Seeds with several runs in one group are not paired.
    """
    def by_seed(runs: list) -> dict[str, object]:
        seeds: dict[str, list] = {}
        for r in runs:
            seeds.setdefault(r.data.params.get("seed", "?"), []).append(r)
        return {s: rs[0] for s, rs in seeds.items() if len(rs) == 1}

    base = by_seed(groups[baseline])
    out: dict[str, dict[str, dict]] = {}
    for m in metrics:
        for g, runs in groups.items():
            if g == baseline:
                continue
            mine = by_seed(runs)
            seeds = [s for s in sorted(mine.keys() & base.keys())
                     if m in mine[s].data.metrics and m in base[s].data.metrics]
            diffs = [mine[s].data.metrics[m] - base[s].data.metrics[m] for s in seeds]
            if diffs:
                mean, half = mean_ci(diffs)
                out.setdefault(m, {})[g] = {"mean": mean, "half": half, "n": len(diffs), "diffs": diffs, "seeds": seeds,
                                            "significant": bool(not math.isnan(half) and abs(mean) > half),
                                            "baseline_mean": float(np.mean([base[s].data.metrics[m] for s in seeds]))}
    return out


def collect(client, *, parent_run_id: str | None = None, experiment: str = "ccexp") -> list:
    if parent_run_id:
        parent = client.get_run(parent_run_id)
        runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                  max_results=10000)
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise CcexpError(f"no MLflow experiment named {experiment!r} in this store")
        runs = [r for r in client.search_runs([exp.experiment_id], max_results=10000)
                if r.data.tags.get("ccexp.sweep") != "true"]
    newest: dict[str, object] = {}  # a configuration run again (a rerun job, the same command twice): its latest run
    for r in sorted((r for r in runs if r.info.status == "FINISHED"), key=lambda r: r.info.start_time):
        newest[configuration_of(r)] = r
    return list(newest.values())


def configuration_of(run) -> str:
    """What makes two MLflow runs one configuration: the full config digest a run records (tag ``config_digest``,
    [`ccexp.names.config_identity`][ccexp.names.config_identity]); for a run from before ccexp tagged it, its name
    and the digest of every param it logged but where it wrote (``paths.*``, ``train.resume_from``). Never the name
    alone, whose 4 hex digits two configurations can share."""
    if run.data.tags.get("config_digest"):
        return run.data.tags["config_digest"]
    params = {k: v for k, v in run.data.params.items() if not k.startswith("paths.") and k != "train.resume_from"}
    return f"{run.info.run_name}:" + hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()


def require_experiment(client, experiment: str):
    """The MLflow experiment ``experiment`` of the store.

    Raises:
        CcexpError: in one line naming the experiments the store has, when it has no such one.
    """
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise CcexpError(f"no MLflow experiment {experiment!r} in this store; pass --experiment (the store has "
                         f"{', '.join(names) or 'none'})")
    return exp


def check_parent(client, parent: str, experiment: str, store: str = "this store", all_runs: bool = True) -> None:
    """``--parent`` of ccexp.report and ccexp.ui: a run that exists in ``experiment`` of the store and is a sweep's
    parent run (tag ``ccexp.sweep``).

    Raises:
        CcexpError: in one line naming the id, the store and what it found (no such run, on a local store or a
            server alike; a run of another experiment; a run that is not a sweep's), and the latest sweep there.
    """
    from mlflow.exceptions import MlflowException

    from ccexp.tracking.store import unreachable

    exp = require_experiment(client, experiment)
    try:
        run = client.get_run(parent)
    except MlflowException as e:
        if unreachable(e) is not None:
            raise
        run = None
    try:
        latest = f"the latest sweep there is {latest_sweep(client, experiment)}"
    except CcexpError:
        latest = f"experiment {experiment!r} holds no sweep"
    if run is None:
        raise CcexpError(f"--parent {parent}: no run with that id in {store}; {latest} (or omit --parent)")
    if run.info.experiment_id != exp.experiment_id:
        raise CcexpError(f"--parent {parent}: that run is not in experiment {experiment!r} of {store} (pass its "
                         f"--experiment); {latest}")
    if run.data.tags.get("ccexp.sweep") != "true":
        raise CcexpError(f"--parent {parent}: run {run.info.run_name} is not a sweep's parent run; {latest} (or "
                         + ("--all-runs to compare every finished run)" if all_runs else "omit --parent)"))


def output_folder(path: Path, flag: str = "--out") -> Path:
    """``path`` as a folder to write into, made when missing.

    Raises:
        CcexpError: in one line when it is a file, or cannot be made (no permission, a file on its way).
    """
    if path.exists() and not path.is_dir():
        raise CcexpError(f"{flag} {path} is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CcexpError(f"{flag} {path} cannot be made ({e.strerror or type(e).__name__}); give a folder you can "
                         "write") from None
    return path


def latest_sweep(client, experiment: str = "ccexp") -> str:
    exp = require_experiment(client, experiment)
    sweeps = client.search_runs([exp.experiment_id], "tags.`ccexp.sweep` = 'true'",
                                order_by=["attributes.start_time DESC"], max_results=1)
    if not sweeps:
        raise CcexpError(f"no sweep in experiment {experiment!r}; run one with `python -m ccexp -m ...`, or use --all-runs")
    return sweeps[0].info.run_id


@dataclass
class Comparison:
    """The runs grouped (by sampler), their metrics' mean ± 95 % CI per group, the paired differences
    against the baseline group (empty when there is none), and what the verdict needs: the smallest
    effect that matters (``min_effect``, a share of the baseline's mean), the power, and the sweep's
    folder and overrides (for the command that extends it)."""

    title: str
    groups: dict[str, list]
    metrics: list[str]
    table: dict[str, dict[str, tuple[float, float]]]
    paired: dict[str, dict[str, dict]]
    baseline: str
    budget: str
    cost: list[str]
    notes: list[str]
    per_cluster: list[str] = field(default_factory=list)
    min_effect: float = 0.02
    power: float = 0.8
    sweep_dir: Path | None = None
    task_overrides: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # "#<job> (<overrides>): <status>: <line>" of the sweep
    left_out: list[str] = field(default_factory=list)  # the note on runs of other settings, when there were some
    moving: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # still_moving's, per group
    budgets: object = None  # the sweep's budgets (ccexp.compare.budget.BudgetStudy): None until write_report
    wanted: int | None = None  # the seeds the extension command asks for (set by verdict())
    primary: str = PRIMARY  # the question the verdict decides (report.primary; the sweep's plan's by default)
    plan: dict | None = None  # the sweep's comparison plan, recorded before its first job (verdict.PLAN_TAG)

    @property
    def post_hoc(self) -> bool:
        """True when the question decided is not the one the sweep's plan fixed before its runs."""
        return self.plan is not None and self.plan.get("primary") != self.primary

    def budget_command(self) -> str | None:
        """The command that runs the cheapest design of ``budgets`` in the same sweep folder (None: none)."""
        from ccexp.compare.budget import design_command
        from ccexp.compare.verdict import python_command

        return None if self.budgets is None else design_command(self.budgets, self.sweep_dir, self.task_overrides,
                                                                 python_command())

    @classmethod
    def of(cls, runs: list, *, title: str, group_by: str, baseline: str, require_baseline: bool,
           **options) -> "Comparison":
        runs, left_out = one_configuration(runs, group_by)
        groups = by_arm(runs, group_by)
        if require_baseline and baseline not in groups:
            raise CcexpError(f"--baseline {baseline!r} has no finished run here; the samplers are {', '.join(groups)}")
        found = sorted({k for r in runs for k in r.data.metrics if any(re.fullmatch(p, k) for p in _PATTERNS)}
                       | _label_values_without_documents(runs),
                       key=lambda k: (k not in HEADLINE, HEADLINE.index(k) if k in HEADLINE else 0, k))
        notes = _identical_streams(runs, group_by) + left_out
        partitions = {_fingerprint(r, "cluster") for r in runs} - {None}
        if len(partitions) > 1:
            notes.append(f"the runs were clustered {len(partitions)} different ways (clusterer.seed or the clusterer's "
                         "settings differ), so cluster c is not the same cluster in every run: the per-cluster rows are "
                         "left out, and macro, worst, rare and common are each taken over the run's own clusters")
        clusters = [] if len(partitions) > 1 else [k for k in found if k.startswith("eval/ppl_cluster/")]
        metrics = [k for k in found if not k.startswith("eval/ppl_cluster/")]
        cost = sorted({k for r in runs for k in r.data.metrics if any(re.fullmatch(p, k) for p in _COST)})
        table = {m: {g: mean_ci([r.data.metrics[m] for r in rs if m in r.data.metrics]) for g, rs in groups.items()}
                 for m in metrics + clusters + cost}
        paired = paired_differences(groups, baseline, metrics) if baseline in groups and len(groups) > 1 else {}
        tokens = sorted({int(r.data.metrics.get("train/tokens", -1)) for r in runs})
        budget = (f"Every run trained on exactly {tokens[0]:,} tokens (a token-fair comparison)." if len(tokens) == 1
                  and tokens[0] >= 0 else "Warning: the runs trained on different numbers of tokens ("
                  + ", ".join(f"{t:,}" for t in tokens if t >= 0) + "): differences mix policy and compute.")
        return cls(title, groups, metrics, table, paired, baseline, budget, cost, notes, clusters, left_out=left_out,
                   **options)

    @property
    def others(self) -> list[str]:
        return [g for g in self.groups if g != self.baseline]

    def seeds(self, g: str) -> list[str]:
        return sorted({r.data.params.get("seed", "?") for r in self.groups[g]}, key=lambda s: (len(s), s))

    def identical_to_baseline(self, g: str) -> bool:
        """True when every run of ``g`` trained on the identical token stream as the baseline's run of its seed."""
        base = {r.data.params.get("seed"): r.data.tags.get("stream_digest") for r in self.groups.get(self.baseline, [])}
        mine = [(r.data.params.get("seed"), r.data.tags.get("stream_digest")) for r in self.groups[g]]
        return bool(mine) and all(d and base.get(s) == d for s, d in mine)

    def cell(self, m: str, g: str) -> str:
        mean, half = self.table[m][g]
        n = sum(m in r.data.metrics for r in self.groups[g])
        if math.isnan(mean):
            return "no held-out documents" if self.no_documents(m, g) else "—"
        return f"{mean:.4g} ± {half:.2g} (n={n})" if n >= 2 else f"{mean:.4g} (1 seed)"

    def no_documents(self, m: str, g: str) -> bool:
        """True when ``m`` is a per-label perplexity and the group's runs had no held-out document of that value."""
        count = _documents_metric(m)
        return count is not None and all(r.data.metrics.get(count, 0) == 0 for r in self.groups[g])

    def heldout_documents(self, m: str) -> int | None:
        """The fewest held-out documents any run scored label metric ``m`` (``eval/ppl_<label>/<value>``) on, from the
        runs' ``eval/heldout_docs_<label>/<value>``; None for another metric or where no run recorded the count."""
        count = None if m.startswith("eval/ppl_cluster/") else _documents_metric(m)
        found = [r.data.metrics[count] for rs in self.groups.values() for r in rs if count in r.data.metrics]
        return int(min(found)) if found else None

    def diff(self, m: str, g: str) -> str:
        d = self.paired.get(m, {}).get(g)
        if d is None:
            return "—"
        ci = f" ± {d['half']:.2g}" if not math.isnan(d["half"]) else ""
        return f"{d['mean']:+.4g}{ci}{' *' if d['significant'] else ''} (n={d['n']})"

    def verdict(self):
        """(rows, extension command): [`ccexp.compare.verdict.verdict_rows`][ccexp.compare.verdict.verdict_rows] and, for a sweep whose
        primary metric needs more seeds, the command that adds them."""
        from ccexp.compare.verdict import extend_command, seeds_wanted, verdict_rows

        rows = verdict_rows(self, self.min_effect, self.power)
        seeds = sorted({s for g in self.groups for s in self.seeds(g)})
        wanted = seeds_wanted(rows)
        if wanted is None and rows and all(r.n < 2 for r in rows):
            wanted = 2  # one seed: no noise to size the sweep with yet; a second seed measures it
        self.wanted = wanted
        return rows, extend_command(self.sweep_dir, self.task_overrides, seeds, wanted)

    def extension_cost(self) -> str | None:
        """What the extension command ([`verdict`][ccexp.compare.report.Comparison.verdict]) costs, from this sweep's
        own runs: "1,912 more runs of 24,576 tokens: about 84.6 CPU-hours one after another (this sweep's median
        9,733 tokens/s and 5 s outside training per run)"; None without an extension or a measured speed."""
        from ccexp.compare.budget import device_time, throughput

        runs = [r for rs in self.groups.values() for r in rs]
        seeds = {s for g in self.groups for s in self.seeds(g)}
        if self.wanted is None or not runs or not seeds or self.wanted <= len(seeds):
            return None
        jobs = math.ceil((self.wanted - len(seeds)) * len(runs) / len(seeds))  # the sweep's jobs per seed, per new seed
        rate, extra = throughput(runs)
        tokens = float(np.median([r.data.metrics.get("train/tokens", 0.0) for r in runs]))
        if not rate == rate or rate <= 0 or tokens <= 0:
            return None
        gpu = any(str(r.data.params.get("trainer.accelerator", "cpu")) in ("gpu", "cuda") for r in runs)
        hours = jobs * (tokens / rate + extra) / 3600
        return (f"{jobs:,} more run(s) of {tokens:,.0f} tokens: about {device_time(hours, 'GPU' if gpu else 'CPU')} one "
                f"after another (this sweep's median {rate:,.0f} tokens/s and {extra:.0f} s outside training per run)")

    def markdown(self) -> str:
        from ccexp.compare.verdict import verdict_markdown

        names = list(self.groups)
        several = any(len(self.seeds(g)) >= 2 for g in names)
        spread = ("Mean ± half-width of the 95 % confidence interval over seeds (Student's t); a sampler with one "
                  "seed has its mean only" if several else "One seed per sampler: means only, no confidence interval")
        rows, command = self.verdict()
        md = [f"# {self.title}", "", *verdict_markdown(self, rows, self.min_effect, self.power, command)]
        if self.budgets is not None and self.budgets.points:  # two seeds or more: how the noise goes with budget
            from ccexp.compare.budget import budget_markdown

            md += budget_markdown(self.budgets, self.budget_command())
        for note in self.notes:
            md += [f"Note: {note}", ""]
        if self.unfinished:
            md += ["## Jobs that did not finish", "", f"{len(self.unfinished)} job(s) of the sweep are not in this "
                   "comparison (each job's `status.json` and `ccexp.log` say more):", "",
                   *[f"- {line}" for line in self.unfinished], ""]

        def table(metrics: list[str], cell) -> list[str]:
            return ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)] + \
                [f"| {m} | " + " | ".join(cell(m, g) for g in names) + " |" for m in metrics]

        md += ["## Every metric", "", f"{spread}; lower is better for perplexities and bits per byte, higher for "
               "accuracies.", "", *table(self.metrics, self.cell)]
        if self.paired:
            md += ["", f"## Paired differences against {self.baseline}", "",
                   f"Sampler − {self.baseline}, run by run with the same seed: mean ± half-width of the 95 % confidence "
                   "interval (Student's t over the pairs); * where the interval excludes 0. **Uncorrected**: each "
                   "row on its own, for reading the raw differences; the verdict above is the decision (its "
                   "question at its level, the rest corrected for their number). † favours balancing by "
                   "construction. For perplexities a negative difference is an improvement.", "",
                   "| metric | " + " | ".join(self.others) + " |", "|---|" + "---:|" * len(self.others)]
            md += [f"| {m}{' †' if m in FAVOURS_BALANCING else ''} | " + " | ".join(self.diff(m, g) for g in self.others)
                   + " |" for m in self.paired]
        if self.per_cluster:
            md += ["", "## Per cluster", "", "Held-out perplexity of each cluster (the same clustering in every run).",
                   "", *table(self.per_cluster, self.cell)]
        if self.cost:
            md += ["", "## Cost", "", "What the runs cost (not quality: it depends on the machine and on what else ran "
                   "on it while they did).", "", *table(self.cost, self.cell)]
        md += ["", "Seeds: " + "; ".join(f"{g}: {', '.join(self.seeds(g))}" for g in names), "",
               "![comparison](comparison.png)", ""]
        if any("curve/ppl" in r.data.metrics for rs in self.groups.values() for r in rs):
            md += ["![held-out curves](curves.png)", ""]
        return "\n".join(md)

    def html(self) -> str:
        """The Markdown report rendered (Python-Markdown, tables and code blocks), one page."""
        import html

        import markdown

        body = markdown.markdown(self.markdown(), extensions=["tables", "fenced_code"])
        from ccexp.clustering.report import PAGE_STYLE

        return f"<!doctype html><meta charset='utf-8'><title>{html.escape(self.title)}</title>{PAGE_STYLE}" + body

    def write_csv(self, out_dir: Path, group_by: str) -> list[Path]:
        with open(out_dir / "comparison.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["metric", group_by, "mean", "ci95_half_width", "n"])
            w.writerows([m, g, *self.table[m][g], sum(m in r.data.metrics for r in rs)]
                        for m in self.metrics + self.per_cluster + self.cost for g, rs in self.groups.items())
        if not self.paired:
            return [out_dir / "comparison.csv"]
        rows = {(r.metric, r.sampler): r for r in self.verdict()[0]}
        with open(out_dir / "paired.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["metric", group_by, "baseline", "mean_difference", "ci95_half_width", "n_pairs", "significant",
                        "verdict", "relative_difference", "relative_ci95_half_width", "sd_difference",
                        "seeds_to_resolve_observed", "seeds_to_detect_min_effect", "seeds_for_min_effect_ci"])
            for m, by in self.paired.items():
                for g, d in by.items():
                    r = rows.get((m, g))
                    extra = [r.verdict, r.rel_mean, r.rel_half, r.sd, r.seeds_observed, r.seeds_min_effect,
                             r.seeds_half_width] if r else [""] * 7
                    w.writerow([m, g, self.baseline, d["mean"], d["half"], d["n"], int(d["significant"]), *extra])
        return [out_dir / "comparison.csv", out_dir / "paired.csv"]


def _fingerprint(run, stage: str) -> str | None:
    """The ``stage`` fingerprint in a run's ``fingerprints`` tag (``corpus=..,cluster=..``), or None."""
    for part in (run.data.tags.get("fingerprints") or "").split(","):
        name, _, fp = part.partition("=")
        if name == stage and fp:
            return fp
    return None


def _label_values_without_documents(runs: list) -> set[str]:
    """``eval/ppl_<label>/<name>`` for every label value some run saw with no held-out documents, so
    the report lists every value (as "no held-out documents") instead of dropping it."""
    out = set()
    for r in runs:
        for k, v in r.data.metrics.items():
            if k.startswith("eval/heldout_docs_") and v == 0:
                head, _, name = k.rpartition("/")
                out.add(f"eval/ppl_{head[len('eval/heldout_docs_'):]}/{name}")
    return out


def _documents_metric(m: str) -> str | None:
    """The held-out document count beside per-label perplexity ``m``: ``eval/ppl_<label>/<value>`` ->
    ``eval/heldout_docs_<label>/<value>``; None for a metric of another kind."""
    head, _, name = m.rpartition("/")
    return f"eval/heldout_docs_{head[len('eval/ppl_'):]}/{name}" if head.startswith("eval/ppl_") else None


def _arm(run, group_by: str) -> str:
    """The group a run belongs to: its ``group_by`` tag, else its ``<group_by>.name`` param."""
    return run.data.tags.get(group_by, run.data.params.get(f"{group_by}.name", "?"))


# params that are not the experiment's configuration: the seeds (what a sweep repeats over) and the settings that
# change nothing a run computes (where and how it is recorded, shown or resumed: the run identity leaves them out too)
_NOT_CONFIGURATION = re.compile(r"(^|\.)(seed|init_seed)$|" + "|".join(f"^{re.escape(k)}(\\.|$)" for k in NOT_COMPUTED))


# the stages whose outputs every run of a comparison must share, whatever its seeds (the clustering, and the
# deduplication decided on it, may differ with clusterer.seed): the same settings on a corpus file rewritten in place,
# or another model file under the same path, are other inputs
SHARED_STAGES = ("corpus", "model", "tokenize", "embed")


def _configuration(run, group_by: str, arm: bool, ignore: tuple[str, ...] = ()) -> frozenset:
    """A run's configuration apart from its seeds: its params but the seeds, the recording's and ``ignore``'s;
    without the ``group_by`` group's own (``arm=False``: what the arms share, with the fingerprints of the
    [`SHARED_STAGES`][ccexp.compare.report.SHARED_STAGES] it recorded, as ``"<stage> fingerprint"``) or with only them
    (``arm=True``)."""
    own = f"{group_by}."
    stages = [] if arm else [(f"{s} fingerprint", fp) for s in SHARED_STAGES if (fp := _fingerprint(run, s))]
    return frozenset([(k, v) for k, v in run.data.params.items()
                      if not _NOT_CONFIGURATION.search(k) and k.startswith(own) == arm and k not in ignore] + stages)


def one_configuration(runs: list, group_by: str, ignore: tuple[str, ...] = ()) -> tuple[list, list[str]]:
    """The runs of one configuration apart from their seeds, and a note naming the runs left out.

    A comparison averages each arm's runs over seeds and pairs them by seed, so every run must share the
    configuration of the newest run (a sweep folder extended with another ``train.lr``, or ``--all-runs`` over
    runs of several settings) and its stages' inputs (a corpus rewritten in place between two runs of the same
    settings: their ``corpus fingerprint`` differs), and within an arm its newest run's settings of that arm
    (``sampler.*``).

    Returns:
        (the runs kept, in their order; [] or one note naming the runs left out and the settings that differ).
    """
    if not runs:
        return runs, []

    def started(r) -> int:
        return getattr(getattr(r, "info", None), "start_time", None) or 0

    newest = max(runs, key=started)
    shared = _configuration(newest, group_by, False, ignore)
    arms: dict[str, frozenset] = {}
    for r in sorted(runs, key=started):  # the newest run of each arm last
        arms[_arm(r, group_by)] = _configuration(r, group_by, True, ignore)
    kept, out, differ = [], [], {}
    for r in runs:
        arm = _arm(r, group_by)
        mine = _configuration(r, group_by, False, ignore) | _configuration(r, group_by, True, ignore)
        ref = shared | arms[arm]
        if mine == ref:
            kept.append(r)
            continue
        out.append(r.info.run_name or r.info.run_id)
        theirs, ours = dict(mine), dict(ref)
        for k in sorted(set(theirs) ^ set(ours) | {k for k in theirs if k in ours and theirs[k] != ours[k]}):
            differ.setdefault(k, (set(), ours.get(k, "unset")))[0].add(theirs.get(k, "unset"))
    if not out:
        return kept, []
    settings = "; ".join(f"{k}={', '.join(sorted(v))} where the newest run has {new}"
                         for k, (v, new) in list(differ.items())[:5]) + ("; ..." if len(differ) > 5 else "")
    names = ", ".join(sorted(out)[:10]) + (f" and {len(out) - 10} more" if len(out) > 10 else "")
    return kept, [f"{len(out)} run(s) left out, of another configuration than the newest run's ({settings}): "
                  f"{names}; they are not averaged or paired with the others (compare them in a sweep folder of "
                  "their own)"]


def _identical_streams(runs: list, group_by: str) -> list[str]:
    """Notes for groups whose runs with the same seed trained on the identical token stream (same
    ``stream_digest`` tag): their differences are not the policies'."""
    by: dict[tuple[str, str], list[str]] = {}
    for r in runs:
        digest = r.data.tags.get("stream_digest")
        if digest:
            by.setdefault((r.data.params.get("seed", "?"), digest), []).append(_arm(r, group_by))
    same: dict[tuple[str, ...], list[str]] = {}
    for (seed, _), groups in by.items():
        if len(set(groups)) > 1:
            same.setdefault(tuple(sorted(set(groups))), []).append(seed)
    return [f"{', '.join(g)} trained on the identical token stream (seed {', '.join(sorted(s))}): the sampling policies "
            "made no difference there" for g, s in same.items()]


def sweep_context(client, parent_run_id: str | None) -> dict:
    """What a sweep's parent run knows beyond its children: its folder and task overrides (for the command
    that extends it) and the arms skipped before training as duplicates (a note)."""
    if not parent_run_id:
        return {}
    import json

    import yaml

    tags = client.get_run(parent_run_id).data.tags
    plan = json.loads(tags[PLAN_TAG]) if tags.get(PLAN_TAG) else None
    pairs: dict[tuple[str, str], list[str]] = {}
    for d in json.loads(tags.get("ccexp.duplicates", "[]")):
        pairs.setdefault((d["sampler"], d["same_as"]), []).append(str(d["seed"]))
    out: dict = {"notes": [f"{a} would have trained on the identical token stream as {b} (seed {', '.join(seeds)}), so "
                           "its runs were skipped before training (report.skip_duplicates=false keeps them): at this "
                           f"budget {a} is {b}" for (a, b), seeds in pairs.items()], "plan": plan}
    sweep_dir = Path(tags["sweep_dir"]) if tags.get("sweep_dir") else None
    if sweep_dir is not None and (sweep_dir / "multirun.yaml").is_file():
        saved = yaml.safe_load((sweep_dir / "multirun.yaml").read_text()) or {}
        out["sweep_dir"] = sweep_dir
        overrides = (saved.get("hydra") or {}).get("overrides") or {}
        # the launcher and its settings (hydra/launcher=packed, hydra.launcher.*) go with every command the report
        # prints for this sweep: the sweep's own folder and mode are the command's to set
        launcher = [str(o) for o in overrides.get("hydra") or []
                    if not str(o).startswith(("hydra.mode=", "hydra.sweep.dir=", "hydra.run.dir="))]
        out["task_overrides"] = launcher + list(overrides.get("task") or [])
    return out


def write_report(client, *, out_dir: Path, parent_run_id: str | None = None, experiment: str = "ccexp",
                 group_by: str = "sampler", baseline: str = "random", require_baseline: bool = False,
                 min_effect: float = 0.02, power: float = 0.8, unfinished: list[str] | None = None,
                 primary: str | None = None) -> tuple[list[Path], "Comparison"]:
    """Write the comparison files for the selected runs; return their paths and the comparison.

    Args:
        baseline: the group the paired differences are taken against; skipped when no run has it,
            unless ``require_baseline``.
        min_effect: the smallest difference that matters, as a share of the baseline's mean (seeds needed);
        power: the power those seeds should give.
        unfinished: the sweep's jobs that did not finish, one line each, listed in the report.
        primary: the question the verdict decides; None: the one the sweep's plan fixed before its runs, else
            [`PRIMARY`][ccexp.compare.verdict.PRIMARY]. Another than the plan's is marked "post hoc".

    Raises:
        CcexpError: if there is no finished run, or ``require_baseline`` and no run of ``baseline``.
    """
    runs = collect(client, parent_run_id=parent_run_id, experiment=experiment)
    if not runs:
        raise CcexpError("no finished runs to compare")
    if not any(re.match(p, k) for r in runs for k in r.data.metrics for p in _PATTERNS):
        raise CcexpError(f"the {len(runs)} finished run(s) of experiment {experiment!r} hold no held-out metric "
                         "(eval/ppl, ...): nothing to compare; they are not training runs (a plan's runs are in "
                         "<experiment>-plan)")
    context = sweep_context(client, parent_run_id)
    comparison = Comparison.of(runs, title="", group_by=group_by, baseline=baseline, require_baseline=require_baseline,
                               min_effect=min_effect, power=power, sweep_dir=context.get("sweep_dir"),
                               task_overrides=context.get("task_overrides", []))
    comparison.plan = context.get("plan")
    comparison.primary = primary or (comparison.plan or {}).get("primary") or PRIMARY
    compared = sum(len(rs) for rs in comparison.groups.values())  # the runs of one configuration (one_configuration)
    comparison.budgets, other_settings = budget_study(runs, group_by, baseline, min_effect, power, comparison.primary)
    if comparison.left_out and len({p.tokens for p in comparison.budgets.points}) >= 2 \
            and not other_settings:  # the runs left out differ from the compared ones in budget alone
        comparison.notes = [n for n in comparison.notes if n not in comparison.left_out] + [
            f"the verdict compares the {compared} runs at the newest run's budget; the {len(runs) - compared} runs at "
            "the sweep's other budgets are in the budget section"]
        comparison.left_out = []
    comparison.title = (f"ccexp comparison: {compared} run{'s' if compared != 1 else ''}"
                        + (f" of sweep {parent_run_id}" if parent_run_id else "")
                        + (" (runs of other settings left out: see the note)" if comparison.left_out else ""))
    comparison.notes += context.get("notes", [])
    comparison.unfinished = list(unfinished or [])
    histories = curve_histories(client, comparison.groups)
    comparison.moving = still_moving(histories, min_effect)
    return _write_files(out_dir, comparison, histories, group_by), comparison


def _write_files(out_dir: Path, comparison: "Comparison", histories: dict, group_by: str) -> list[Path]:
    """The report's files in ``out_dir``, written whole in a temporary folder and then moved in (a failed write
    leaves the old report); their paths."""
    import os
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        (tmp / "report.md").write_text(comparison.markdown())
        (tmp / "report.html").write_text(comparison.html())
        comparison.write_csv(tmp, group_by)
        _plot(tmp / "comparison.png", comparison, [m for m in HEADLINE if m in comparison.table] or comparison.metrics[:4])
        curves_plot(histories, comparison.groups, tmp / "curves.png", comparison.title)
        files = [out_dir / name for name in ("report.md", "report.html", "comparison.csv", "paired.csv",
                                             "comparison.png", "curves.png") if (tmp / name).is_file()]
        for f in files:
            os.replace(tmp / f.name, f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files


CURVE_PANELS = [("curve/ppl", "all tokens"), ("curve/ppl_macro", "macro over clusters"),
                ("curve/ppl_worst", "worst cluster")]


def by_arm(runs: list, group_by: str) -> dict[str, list]:
    """The runs grouped by their arm (their ``group_by`` tag or ``<group_by>.name`` param), arms sorted."""
    groups: dict[str, list] = {}
    for r in runs:
        groups.setdefault(_arm(r, group_by), []).append(r)
    return dict(sorted(groups.items()))


def budget_study(runs: list, group_by: str, baseline: str, min_effect: float, power: float, primary: str = PRIMARY):
    """[`ccexp.compare.budget.study`][ccexp.compare.budget.study] of the runs of one configuration apart from
    their seeds and their budget (``train.steps``, ``train.passes``), on the primary metric; and
    [`one_configuration`][ccexp.compare.report.one_configuration]'s note on runs of other settings than budget
    ([] when the runs differ in nothing else)."""
    from ccexp.compare.budget import study
    from ccexp.compare.verdict import metric_name

    same, other_settings = one_configuration(runs, group_by, ignore=BUDGET_KEYS)
    metric = primary if any(primary in r.data.metrics for r in same) else "eval/ppl"
    out = study(by_arm(same, group_by), baseline, metric, min_effect, power)
    out.metric = metric_name(metric)
    return out, other_settings


def curve_histories(client, groups: dict[str, list]) -> dict[tuple[str, str], list[dict[int, float]]]:
    """{(group, curve metric): one {tokens trained: value} per run} for the curves of ``CURVE_PANELS``."""
    return {(g, m): [{p.step: p.value for p in client.get_metric_history(r.info.run_id, m)} for r in runs]
            for g, runs in groups.items() for m, _ in CURVE_PANELS if hasattr(runs[0], "info")}


def mean_curve(histories: dict, g: str, metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens trained int64[n], the runs' values float64[runs, n], their mean float64[n]) of group ``g``'s curve
    at the points every run has; empty arrays when it has none."""
    series = [h for h in histories.get((g, metric), []) if h]
    steps = sorted(set.intersection(*(set(h) for h in series))) if series else []
    values = np.array([[h[t] for t in steps] for h in series], dtype=np.float64).reshape(len(series), len(steps))
    return np.array(steps, dtype=np.int64), values, values.mean(axis=0) if steps else np.zeros(0)


def still_moving(histories: dict, min_change: float, metric: str = "curve/ppl_macro"
                 ) -> dict[str, tuple[float, float, float]]:
    """The groups whose held-out curve (``metric``, the mean over their runs) still changed by more than
    ``min_change`` (a share, the report's ``min_effect``) over the last ``MOVING_TAIL`` of the tokens
    trained: {group: (relative change, tokens at the earlier point, tokens at the last)}. Such a verdict
    holds where training stopped, not beyond it. Every point of the tail is compared with the last, from the
    curve's last point at or before ``1 - MOVING_TAIL`` of the tokens on (so a jump between two evaluations
    counts), and the point farthest from the last is the one reported; groups whose curve has no point within
    ``2 * MOVING_TAIL`` of the end before the tail (a coarse ``eval.every_n_steps``) are left out."""
    from ccexp.compare.verdict import MOVING_TAIL

    out = {}
    for g in dict.fromkeys(k[0] for k in histories):
        tokens, _, mean = mean_curve(histories, g, metric)
        if tokens.size < 2:
            continue
        earlier = np.flatnonzero(tokens <= tokens[-1] * (1 - MOVING_TAIL))
        if earlier.size == 0 or tokens[earlier[-1]] < tokens[-1] * (1 - 2 * MOVING_TAIL):
            continue  # no curve point in the last two fifths but the end: too coarse to tell
        tail = np.arange(int(earlier[-1]), tokens.size - 1)
        i = int(tail[np.argmax(np.abs(mean[-1] / mean[tail] - 1))])
        change = float(mean[-1] / mean[i] - 1)
        if abs(change) > min_change:
            out[g] = (change, float(tokens[i]), float(tokens[-1]))
    return out


def curves_plot(histories: dict, groups: dict[str, list], path: Path, title: str) -> Path | None:
    """The held-out curves (``curve/ppl``, ``curve/ppl_macro``, ``curve/ppl_worst`` against tokens trained,
    from [`curve_histories`][ccexp.compare.report.curve_histories]), one line per group — the mean over its
    runs, with the min-max band — or None when no run has a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = CURVE_PANELS
    if not any(h for hs in histories.values() for h in hs):
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (metric, label) in zip(axes, panels):
        for i, g in enumerate(groups):
            steps, values, mean = mean_curve(histories, g, metric)
            if not steps.size:
                continue
            x = steps / 1e6
            ax.plot(x, mean, color=f"C{i}", label=f"{g} (mean of {len(values)} run(s))",
                    ls=("-", "--", ":", "-.")[i % 4], marker=("o", "x", "+", "^", "s")[i % 5], ms=4, mfc="none")
            # (line styles and markers: samplers whose curves coincide stay visible)
            if len(values) > 1:
                ax.fill_between(x, values.min(axis=0), values.max(axis=0), color=f"C{i}", alpha=0.15)
        ax.set(xlabel="tokens trained (millions)", ylabel="held-out perplexity (fixed sample)", yscale="log", title=label)
        ax.grid(alpha=0.3)
    next((ax for ax in axes if ax.lines), axes[0]).legend(fontsize=8)
    fig.suptitle(f"{title}: held-out perplexity during training (band: min-max over runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot(path: Path, comparison: "Comparison", metrics: list[str]) -> None:
    """The headline metrics as bars per group; whiskers (95 % CI) only where a group has 2 seeds or more."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(comparison.groups)
    seeds = {g: len({r.data.params.get("seed", "?") for r in rs}) for g, rs in comparison.groups.items()}
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.6), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        means = [comparison.table[m][g][0] for g in names]
        errs = [comparison.table[m][g][1] for g in names]  # NaN (1 seed): no whisker is drawn
        ax.bar(names, means, yerr=errs if not all(math.isnan(e) for e in errs) else None, capsize=4,
               color=[f"C{i}" for i in range(len(names))])
        ax.set_title(m.replace("eval/", ""))
        ax.set_ylabel("held-out perplexity" if m.startswith("eval/ppl") else m)
        ax.tick_params(axis="x", rotation=30)
    low, high = min(seeds.values()), max(seeds.values())
    spread = (f"mean ± 95 % CI over {low} seeds" if low == high >= 2 else
              "mean of 1 seed (no interval)" if high < 2 else f"mean over {low}–{high} seeds, 95 % CI where ≥ 2")
    fig.suptitle(f"{comparison.title}: {spread}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline_differences(comparison: "Comparison") -> dict[str, dict[str, float]]:
    """Per run id: each headline perplexity's difference against the baseline's run of the same seed, in per cent of
    the baseline's mean over the pairs (2 decimals), under [`DIFFERENCE_KEYS`][ccexp.evaluation.heldout.DIFFERENCE_KEYS]
    (``macro vs random pct``), and beside it ``<key> ci``, the 95 % CI half-width of the sampler's mean difference
    (the same on each of its runs; none from one pair); the baseline's own runs get 0. One definition for one name:
    the mean of a sampler's values (what the MLflow view's group row shows) is the report's paired difference and
    the parent run's ``<sampler> macro vs random pct``, not a mean of per-seed ratios. Runs not paired (no baseline
    run of their seed, or two runs of one seed) get none."""
    from ccexp.evaluation.heldout import DIFFERENCE_KEYS

    out: dict[str, dict[str, float]] = {}
    for name in DIFFERENCE_KEYS:
        key = DIFFERENCE_KEYS[name].format(baseline=comparison.baseline)
        for g, d in comparison.paired.get(f"eval/{name}", {}).items():
            if not d["baseline_mean"]:
                continue
            diff = dict(zip(d["seeds"], d["diffs"]))
            for r in comparison.groups[g]:
                if (seed := r.data.params.get("seed", "?")) in diff:
                    mine = out.setdefault(r.info.run_id, {})
                    mine[key] = round(100.0 * diff[seed] / d["baseline_mean"], 2)
                    if not math.isnan(d["half"]):
                        mine[f"{key} ci"] = round(100.0 * d["half"] / d["baseline_mean"], 2)
            for r in comparison.groups[comparison.baseline]:  # the baseline's own runs of the paired seeds
                if r.data.params.get("seed", "?") in diff:
                    out.setdefault(r.info.run_id, {})[key] = 0.0
    return out


SUMMARY_NAMES = {"eval/bpb": ("bpb", "bpb", 4), "eval/ppl_macro": ("macro ppl", "macro", 2), "eval/ppl": ("ppl", "ppl", 2)}
"""The parent run's names for a metric at a glance: (its mean's name, its difference's prefix, decimals)."""


def sampler_summary(comparison: "Comparison", metric: str = PRIMARY) -> dict[str, float]:
    """The sweep's parent run's metrics, each sampler at a glance on ``metric`` (the question; overall ppl where
    no run has it): ``<sampler> bpb`` (the mean over its seeds) and, for each sampler paired with the baseline,
    ``<sampler> bpb vs <baseline> pct`` and its 95 % CI half-width ``... pct ci`` (per cent of the baseline's mean
    over the pairs; 2 decimals; no ``ci`` from one pair). Other metrics are named by
    [`SUMMARY_NAMES`][ccexp.compare.report.SUMMARY_NAMES] (``macro ppl``, ``macro vs ...``), else by their name."""
    metric = metric if metric in comparison.table else "eval/ppl"
    name, prefix, decimals = SUMMARY_NAMES.get(metric, (metric, metric, 4))
    out: dict[str, float] = {}
    for g in comparison.groups:
        mean = comparison.table.get(metric, {}).get(g, (math.nan,))[0]
        if not math.isnan(mean):
            out[f"{g} {name}"] = round(mean, decimals)
        d = comparison.paired.get(metric, {}).get(g)
        if d is not None and d["baseline_mean"]:
            out[f"{g} {prefix} vs {comparison.baseline} pct"] = round(100 * d["mean"] / d["baseline_mean"], 2)
            if not math.isnan(d["half"]):
                out[f"{g} {prefix} vs {comparison.baseline} pct ci"] = round(100 * d["half"] / d["baseline_mean"], 2)
    return out


def parent_description(comparison: "Comparison", verdict: list[str]) -> str:
    """The sweep's parent run's description (MLflow renders it as Markdown on the run's page): the verdict lines
    the sweep printed, and where the chart and the report are."""
    body = [f"**{comparison.title}**", ""]
    if verdict:
        body += [verdict[0], ""] + [f"- {line.strip()}" for line in verdict[1:]] + [""]
    body += [f"Chart: the artifact `by_sampler.png` (each sampler's {metric_name(comparison.primary)}, and its paired "
             f"difference against {comparison.baseline} with its interval at the verdict's level). The whole report: "
             "`report/report.html`. "
             "Metrics: each sampler's mean and its difference against the baseline."]
    return "\n".join(body)


def sampler_chart(path: Path, comparison: "Comparison", metric: str = PRIMARY) -> Path | None:
    """The comparison at a glance: ``metric`` (the question) by sampler (mean, 95 % CI whiskers from 2 seeds on) and
    each sampler's paired difference against the baseline in per cent (mean, its interval at the verdict's level over
    the seed pairs), the verdict written on each bar. None when no run has ``metric``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ccexp.compare.verdict import HEADLINE_NAMES

    if metric not in comparison.table:
        return None
    names = list(comparison.groups)
    means = [comparison.table[metric][g][0] for g in names]
    halves = [comparison.table[metric][g][1] for g in names]
    others = [g for g in comparison.others if g in comparison.paired.get(metric, {})]
    fig, axes = plt.subplots(1, 2 if others else 1, figsize=(11 if others else 5.5, 3.8), squeeze=False)
    ax = axes[0][0]
    ax.bar(names, means, yerr=None if all(math.isnan(h) for h in halves) else halves, capsize=5,
           color=[f"C{i}" for i in range(len(names))])
    unit = "bits per byte" if "bpb" in metric else "perplexity"
    ax.set(title=HEADLINE_NAMES.get(metric, metric), ylabel=f"held-out {unit} (lower is better)")
    ax.tick_params(axis="x", rotation=20)
    if others:
        ax = axes[0][1]
        rel = [comparison.paired[metric][g] for g in others]
        rows = {r.sampler: r for r in comparison.verdict()[0] if r.metric == metric}
        pct = [100 * d["mean"] / d["baseline_mean"] for d in rel]
        err = [100 * rows[g].half / d["baseline_mean"] if g in rows else math.nan for g, d in zip(others, rel)]
        ax.bar(others, pct, yerr=None if all(math.isnan(e) for e in err) else err, capsize=5,
               color=[f"C{names.index(g)}" for g in others])
        ax.axhline(0, color="black", lw=0.8)
        words = [rows[g].verdict if g in rows else "unresolved" for g in others]  # under each bar, clear of its whisker
        ax.set_xticks(range(len(others)), [f"{g}\n{w} (n={d['n']})" for g, w, d in zip(others, words, rel)])
        level = next((r.level for r in rows.values() if r.verdict != "identical stream"), 0.95)
        ax.set(title=f"paired difference against {comparison.baseline} ({level:.1%} interval)",
               ylabel=f"% of {comparison.baseline}'s (negative is better)")
    seeds = sorted({len({r.data.params.get("seed") for r in rs}) for rs in comparison.groups.values()})
    fig.suptitle(f"{comparison.title}: mean ± 95 % CI over " + (f"{seeds[0]} seeds" if len(seeds) == 1 else
                 f"{seeds[0]}–{seeds[-1]} seeds") + (" (1 seed: no interval)" if seeds[-1] < 2 else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def store_uri(store: str | None, tracking_uri: str | None = None) -> str:
    """The MLflow tracking URI a viewer reads ([`cli_store`][ccexp.compare.report.cli_store])."""
    return cli_store(store, tracking_uri).uri


def cli_store(store: str | None, tracking_uri: str | None = None):
    """The store of ``ccexp.report`` and ``ccexp.ui``, as MLflow's clients decide it: ``--tracking-uri``, else
    the SQLite file ``--store``, else ``MLFLOW_TRACKING_URI``, else ``outputs/mlflow.db``. A SQLite store must
    be a file that exists (MLflow would make any other path, an empty file too, into a new store). A
    [`ccexp.tracking.store.Store`][ccexp.tracking.store.Store].

    Raises:
        CcexpError: when there is no such store file.
    """
    import os

    from ccexp.tracking.store import Store, absolute

    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if tracking_uri:
        uri, source = absolute(tracking_uri), "--tracking-uri"
    elif store:
        uri, source = None, "--store"
    elif env:
        uri, source = absolute(env), "MLFLOW_TRACKING_URI"
    else:
        store, uri, source = "outputs/mlflow.db", None, "default-cli"
    if uri is not None and not uri.startswith("sqlite:///"):
        return Store(uri, source, env if env and source != "MLFLOW_TRACKING_URI" and absolute(env) != uri else "")
    path = Path(store).expanduser() if uri is None else Path(uri[len("sqlite:///"):])
    if path.is_dir() and (path / "mlflow.db").is_file():  # the outputs folder that holds the store
        path = path / "mlflow.db"
    if not path.is_file():
        raise CcexpError(f"no MLflow store at {path}; run ccexp first or pass --store / --tracking-uri")
    with open(path, "rb") as f:  # MLflow would turn any other file (an empty one too) into a new store
        if f.read(16) != b"SQLite format 3\x00":
            raise CcexpError(f"{path} is not an MLflow store (not a SQLite database); pass the mlflow.db that ccexp "
                             "wrote (<paths.outputs>/mlflow.db)")
    uri = f"sqlite:///{path.resolve()}"
    return Store(uri, source, env if env and source != "MLFLOW_TRACKING_URI" and absolute(env) != uri else "")


def outputs_argument(argv: list[str] | None) -> list[str]:
    """``ccexp.report``'s and ``ccexp.ui``'s arguments with ccexp's own way of naming the outputs folder,
    ``paths.outputs=<dir>`` (as the run was given it), read as ``--store <dir>`` (the store in it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return [x for a in argv for x in (("--store", a.split("=", 1)[1]) if a.startswith("paths.outputs=") else (a,))]


def main(argv: list[str] | None = None) -> None:
    from ccexp.help import plain

    argv = outputs_argument(argv)
    ap = argparse.ArgumentParser(prog="python -m ccexp.report", description=plain(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=None,
                    help="SQLite MLflow store, or the outputs folder that holds it (paths.outputs=<dir> also works; "
                         "default: MLFLOW_TRACKING_URI when set, else outputs/mlflow.db)")
    ap.add_argument("--tracking-uri", default=None, help="any MLflow tracking URI, a server's too (overrides --store)")
    ap.add_argument("--experiment", default="ccexp")
    ap.add_argument("--parent", default=None, help="a sweep's parent run id (default: the latest sweep)")
    ap.add_argument("--all-runs", action="store_true", help="compare every finished run of the experiment")
    ap.add_argument("--out", default=None, help="output folder (default outputs/reports/<sweep or experiment>)")
    ap.add_argument("--baseline", default=None,
                    help="sampler the paired differences are taken against (default: random, when the runs have it)")
    ap.add_argument("--min-effect", type=float, default=0.02,
                    help="the smallest difference that matters, as a share of the baseline's mean (default 0.02)")
    ap.add_argument("--power", type=float, default=0.8, help="the power the seeds needed should give (default 0.8)")
    ap.add_argument("--primary", default=None, help="the question the verdict decides (default: the one the sweep "
                    f"recorded before its runs, else {PRIMARY}); another than the sweep's is marked post hoc")
    args = ap.parse_args(argv)
    if not 0 < args.min_effect < 1 or not 0 < args.power < 1:
        ap.error(f"--min-effect={args.min_effect} and --power={args.power} must be in (0, 1)")
    try:
        if args.primary is not None:
            check_primary(args.primary)
        from ccexp.tracking.store import check_server, read_store

        store = cli_store(args.store, args.tracking_uri)
        check_server(store)
        print(store.line("ccexp.report"), file=sys.stderr)
        client = read_store(store.uri)
        if args.parent and not args.all_runs:
            check_parent(client, args.parent, args.experiment, store.uri)
        parent = None if args.all_runs else (args.parent or latest_sweep(client, args.experiment))
        # beside the store it reads (outputs/reports/ for outputs/mlflow.db), not in the working folder
        home = Path(store.uri[len("sqlite:///"):]).parent if store.uri.startswith("sqlite:///") else Path("outputs")
        out = output_folder(Path(args.out or home / "reports" / (parent or args.experiment)))
        files, comparison = write_report(client, out_dir=out, parent_run_id=parent, experiment=args.experiment,
                                         baseline=args.baseline or "random", require_baseline=args.baseline is not None,
                                         min_effect=args.min_effect, power=args.power, primary=args.primary)
        from ccexp.compare.verdict import verdict_lines

        print("\n".join(verdict_lines(comparison, *comparison.verdict())))
        for note in comparison.left_out:
            print(f"report: {note}")
        print(f"report: {files[0]}")
    except CcexpError as e:
        print(f"ccexp.report: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from ccexp.runtime import run_command

    run_command(main)
