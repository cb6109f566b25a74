"""Comparison report across runs: ``python -m ccexp.report``.

Reads the runs of a sweep (the children of an MLflow parent run; by default the latest sweep) or of
a whole experiment from the MLflow store, groups them by sampler, and writes, for every held-out and
lm-eval metric, the mean over seeds with a 95 % confidence interval (Student's t with n-1 degrees
of freedom; n/a for a single seed), and — against a baseline sampler (``--baseline``, default
``random`` when present) — the *paired* difference of every other sampler, run by run with the same
seed: the mean difference with its 95 % confidence interval (Student's t over the n pairs) and a
mark where the interval excludes 0. Pairing by seed removes the variance the samplers share (the
clustering and initialisation follow the seed), so it detects smaller effects than comparing the
two means. The report also states whether every run trained on the same number of tokens.
Files: ``report.md``, ``report.html``, ``comparison.csv``, ``paired.csv`` and ``comparison.png``
(the headline metrics as bars with CI whiskers).

Usage:
    python -m ccexp.report                                   # latest sweep in outputs/mlflow.db
    python -m ccexp.report --parent <run id> --out reports/x --baseline uniform
    python -m ccexp.report --all-runs --experiment ccexp
"""
from __future__ import annotations

import argparse
import csv
import html
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ccexp.errors import CcexpError

HEADLINE = ["eval/ppl", "eval/ppl_macro", "eval/ppl_worst", "eval/ppl_rare", "eval/ppl_common"]
_PATTERNS = [r"eval/ppl(_macro|_worst|_rare|_common)?$", r"eval/ppl_[a-z_]+/.+", r"lm_eval/.+/(acc|acc_norm)$",
             r"lm_eval/.+/word_perplexity$"]
# what a run cost: depends on the machine and what else ran on it, so it is kept apart from quality
_COST = [r"train/tokens_per_s$", r"time/train_seconds$", r"time/total_seconds$"]


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the ``level`` confidence interval (Student's t); half-width NaN for n < 2."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    if x.size < 2:
        return float(x.mean()) if x.size else math.nan, math.nan
    half = stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return float(x.mean()), float(half)


def paired_differences(groups: dict[str, list], baseline: str, metrics: list[str]) -> dict[str, dict[str, dict]]:
    """Per metric and sampler: runs paired with the baseline's run of the same seed.

    Returns:
        ``{metric: {sampler: {"mean", "half", "n", "significant"}}}`` with ``mean`` the mean of
        (sampler − baseline) over the pairs, ``half`` the half-width of its 95 % confidence interval
        (Student's t, n−1 degrees of freedom; NaN for n < 2) and ``significant`` true where the
        interval excludes 0. Seeds with several runs in one group are not paired.
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
            diffs = [mine[s].data.metrics[m] - base[s].data.metrics[m] for s in sorted(mine.keys() & base.keys())
                     if m in mine[s].data.metrics and m in base[s].data.metrics]
            if diffs:
                mean, half = mean_ci(diffs)
                out.setdefault(m, {})[g] = {"mean": mean, "half": half, "n": len(diffs),
                                            "significant": bool(not math.isnan(half) and abs(mean) > half)}
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
    return [r for r in runs if r.info.status == "FINISHED"]


def latest_sweep(client, experiment: str = "ccexp") -> str:
    exp = client.get_experiment_by_name(experiment)
    sweeps = client.search_runs([exp.experiment_id], "tags.`ccexp.sweep` = 'true'",
                                order_by=["attributes.start_time DESC"], max_results=1) if exp else []
    if not sweeps:
        raise CcexpError(f"no sweep in experiment {experiment!r}; run one with `python -m ccexp -m ...`, or use --all-runs")
    return sweeps[0].info.run_id


@dataclass
class Comparison:
    """The runs grouped (by sampler), their metrics' mean ± 95 % CI per group, and the paired
    differences against the baseline group (empty when there is none)."""

    title: str
    groups: dict[str, list]
    metrics: list[str]
    table: dict[str, dict[str, tuple[float, float]]]
    paired: dict[str, dict[str, dict]]
    baseline: str
    budget: str
    cost: list[str]
    notes: list[str]

    @classmethod
    def of(cls, runs: list, *, title: str, group_by: str, baseline: str, require_baseline: bool) -> "Comparison":
        groups: dict[str, list] = {}
        for r in runs:
            groups.setdefault(r.data.tags.get(group_by, r.data.params.get(f"{group_by}.name", "?")), []).append(r)
        groups = dict(sorted(groups.items()))
        if require_baseline and baseline not in groups:
            raise CcexpError(f"--baseline {baseline!r} has no finished run here; the samplers are {', '.join(groups)}")
        metrics = sorted({k for r in runs for k in r.data.metrics if any(re.fullmatch(p, k) for p in _PATTERNS)}
                         | _label_values_without_documents(runs),
                         key=lambda k: (k not in HEADLINE, HEADLINE.index(k) if k in HEADLINE else 0, k))
        cost = sorted({k for r in runs for k in r.data.metrics if any(re.fullmatch(p, k) for p in _COST)})
        table = {m: {g: mean_ci([r.data.metrics[m] for r in rs if m in r.data.metrics]) for g, rs in groups.items()}
                 for m in metrics + cost}
        paired = paired_differences(groups, baseline, metrics) if baseline in groups and len(groups) > 1 else {}
        tokens = sorted({int(r.data.metrics.get("train/tokens", -1)) for r in runs})
        budget = (f"Every run trained on exactly {tokens[0]:,} tokens (a token-fair comparison)." if len(tokens) == 1
                  and tokens[0] >= 0 else "Warning: the runs trained on different numbers of tokens ("
                  + ", ".join(f"{t:,}" for t in tokens if t >= 0) + "): differences mix policy and compute.")
        return cls(title, groups, metrics, table, paired, baseline, budget, cost, _identical_streams(runs, group_by))

    @property
    def others(self) -> list[str]:
        return [g for g in self.groups if g != self.baseline]

    def cell(self, m: str, g: str) -> str:
        mean, half = self.table[m][g]
        n = sum(m in r.data.metrics for r in self.groups[g])
        if math.isnan(mean):
            return "no held-out documents" if self._no_documents(m, g) else "—"
        return f"{mean:.4g} ± {half:.2g} (n={n})" if n >= 2 else f"{mean:.4g} (1 seed)"

    def _no_documents(self, m: str, g: str) -> bool:
        """True when ``m`` is a per-label perplexity and the group's runs had no held-out document of that value."""
        head, _, name = m.rpartition("/")
        if not head.startswith("eval/ppl_"):
            return False
        count = f"eval/heldout_docs_{head[len('eval/ppl_'):]}/{name}"
        return all(r.data.metrics.get(count, 0) == 0 for r in self.groups[g])

    def diff(self, m: str, g: str) -> str:
        d = self.paired.get(m, {}).get(g)
        if d is None:
            return "—"
        ci = f" ± {d['half']:.2g}" if not math.isnan(d["half"]) else ""
        return f"{d['mean']:+.4g}{ci}{' *' if d['significant'] else ''} (n={d['n']})"

    def markdown(self) -> str:
        names = list(self.groups)
        several = any(len({r.data.params.get("seed") for r in rs}) >= 2 for rs in self.groups.values())
        spread = ("Mean ± half-width of the 95 % confidence interval over seeds (Student's t); a sampler with one "
                  "seed has its mean only" if several else "One seed per sampler: means only, no confidence interval")
        md = [f"# {self.title}", "", self.budget, "", f"{spread}; lower is better for perplexities, higher for "
              "accuracies.", "",
              "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        md += [f"| {m} | " + " | ".join(self.cell(m, g) for g in names) + " |" for m in self.metrics]
        if self.notes:
            md += [""] + [f"Note: {n}" for n in self.notes]
        if self.cost:
            md += ["", "## Cost", "", "What the runs cost (not quality: it depends on the machine and on what else ran "
                   "on it while they did).", "",
                   "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
            md += [f"| {m} | " + " | ".join(self.cell(m, g) for g in names) + " |" for m in self.cost]
        if self.paired:
            md += ["", f"## Paired differences against {self.baseline}", "",
                   f"Sampler − {self.baseline}, run by run with the same seed: mean ± half-width of the 95 % confidence "
                   "interval (Student's t over the pairs); * where the interval excludes 0. For perplexities a "
                   "negative difference is an improvement.", "",
                   "| metric | " + " | ".join(self.others) + " |", "|---|" + "---:|" * len(self.others)]
            md += [f"| {m} | " + " | ".join(self.diff(m, g) for g in self.others) + " |" for m in self.paired]
        seeds = {g: sorted({r.data.params.get("seed", "?") for r in rs}) for g, rs in self.groups.items()}
        md += ["", "Seeds: " + "; ".join(f"{g}: {', '.join(s)}" for g, s in seeds.items()), "",
               "![comparison](comparison.png)", ""]
        return "\n".join(md)

    def html(self) -> str:
        def table(rows: list[str], cols: list[str], cell) -> str:
            head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
            body = "".join("<tr><td>" + html.escape(m) + "</td>" + "".join(f"<td>{html.escape(cell(m, g))}</td>"
                                                                          for g in cols) + "</tr>" for m in rows)
            return f"<table border=1 cellpadding=4><tr><th>metric</th>{head}</tr>{body}</table>"

        paired = (f"<h2>Paired differences against {html.escape(self.baseline)}</h2><p>Same seed, mean ± 95 % CI; "
                  "* where the interval excludes 0.</p>" + table(list(self.paired), self.others, self.diff)
                  ) if self.paired else ""
        notes = "".join(f"<p>Note: {html.escape(n)}</p>" for n in self.notes)
        cost = ("<h2>Cost</h2><p>Not quality: it depends on the machine and on what else ran on it.</p>"
                + table(self.cost, list(self.groups), self.cell)) if self.cost else ""
        return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<h1>{html.escape(self.title)}</h1><p>{html.escape(self.budget)}</p><p>Mean ± 95 % CI over seeds.</p>"
                + table(self.metrics, list(self.groups), self.cell) + notes + cost + paired
                + "<p><img src='comparison.png'></p>")

    def write_csv(self, out_dir: Path, group_by: str) -> list[Path]:
        with open(out_dir / "comparison.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["metric", group_by, "mean", "ci95_half_width", "n"])
            w.writerows([m, g, *self.table[m][g], sum(m in r.data.metrics for r in rs)]
                        for m in self.metrics + self.cost for g, rs in self.groups.items())
        if not self.paired:
            return [out_dir / "comparison.csv"]
        with open(out_dir / "paired.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["metric", group_by, "baseline", "mean_difference", "ci95_half_width", "n_pairs", "significant"])
            w.writerows([m, g, self.baseline, d["mean"], d["half"], d["n"], int(d["significant"])]
                        for m, by in self.paired.items() for g, d in by.items())
        return [out_dir / "comparison.csv", out_dir / "paired.csv"]


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


def _identical_streams(runs: list, group_by: str) -> list[str]:
    """Notes for groups whose runs with the same seed trained on the identical token stream (same
    ``stream_digest`` tag): their differences are not the policies'."""
    by: dict[tuple[str, str], list[str]] = {}
    for r in runs:
        digest = r.data.tags.get("stream_digest")
        if digest:
            by.setdefault((r.data.params.get("seed", "?"), digest), []).append(
                r.data.tags.get(group_by, r.data.params.get(f"{group_by}.name", "?")))
    same: dict[tuple[str, ...], list[str]] = {}
    for (seed, _), groups in by.items():
        if len(set(groups)) > 1:
            same.setdefault(tuple(sorted(set(groups))), []).append(seed)
    return [f"{', '.join(g)} trained on the identical token stream (seed {', '.join(sorted(s))}): the sampling policies "
            "made no difference there" for g, s in same.items()]


def write_report(client, *, out_dir: Path, parent_run_id: str | None = None, experiment: str = "ccexp",
                 group_by: str = "sampler", baseline: str = "random", require_baseline: bool = False) -> list[Path]:
    """Write the comparison files for the selected runs; return their paths.

    Args:
        baseline: the group the paired differences are taken against; skipped when no run has it,
            unless ``require_baseline``.

    Raises:
        CcexpError: if there is no finished run, or ``require_baseline`` and no run of ``baseline``.
    """
    runs = collect(client, parent_run_id=parent_run_id, experiment=experiment)
    if not runs:
        raise CcexpError("no finished runs to compare")
    title = f"ccexp comparison: {len(runs)} runs" + (f" of sweep {parent_run_id}" if parent_run_id else "")
    comparison = Comparison.of(runs, title=title, group_by=group_by, baseline=baseline, require_baseline=require_baseline)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(comparison.markdown())
    (out_dir / "report.html").write_text(comparison.html())
    tables = comparison.write_csv(out_dir, group_by)
    _plot(out_dir / "comparison.png", comparison, [m for m in HEADLINE if m in comparison.table] or comparison.metrics[:4])
    return [out_dir / "report.md", out_dir / "report.html", *tables, out_dir / "comparison.png"]


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ccexp.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="outputs/mlflow.db", help="SQLite MLflow store (default outputs/mlflow.db)")
    ap.add_argument("--tracking-uri", default=None, help="any MLflow tracking URI (overrides --store)")
    ap.add_argument("--experiment", default="ccexp")
    ap.add_argument("--parent", default=None, help="a sweep's parent run id (default: the latest sweep)")
    ap.add_argument("--all-runs", action="store_true", help="compare every finished run of the experiment")
    ap.add_argument("--out", default=None, help="output folder (default outputs/reports/<sweep or experiment>)")
    ap.add_argument("--baseline", default=None,
                    help="sampler the paired differences are taken against (default: random, when the runs have it)")
    args = ap.parse_args(argv)
    try:
        from mlflow import MlflowClient

        if args.tracking_uri:
            uri = args.tracking_uri
        else:
            store = Path(args.store).expanduser()
            if not store.is_file():
                raise CcexpError(f"no MLflow store at {store}; run ccexp first or pass --store / --tracking-uri")
            uri = f"sqlite:///{store.resolve()}"
        client = MlflowClient(uri)
        parent = None if args.all_runs else (args.parent or latest_sweep(client, args.experiment))
        out = Path(args.out or Path("outputs") / "reports" / (parent or args.experiment))
        files = write_report(client, out_dir=out, parent_run_id=parent, experiment=args.experiment,
                             baseline=args.baseline or "random", require_baseline=args.baseline is not None)
        print(f"report: {files[0]}")
    except CcexpError as e:
        print(f"ccexp.report: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
