"""The decisive study, end to end: random vs uniform vs ClusterClip at one equal token budget on a
debmix corpus, with as many seeds as the power estimate asks for, the variance split into its
sources, and the averaged-evaluation measurement — into ``docs/studies/decisive/``.

Steps (each skips what its sweep folder already finished, so an interrupted study resumes):

1. ``corpus``: builds the study corpus from the team's debmix corpus (all 11 domains, every domain
   sampled at 8 % so the imbalance is kept, documents cut at 2,000 characters) into
   ``<outputs>/data/debmix_decisive.jsonl.gz``.
2. ``averaging``: random and uniform x 6 seeds with checkpoints every 20 steps; every checkpoint is
   scored on the whole held-out split, and each way of averaging (the last checkpoint, the EMA of the
   weights, the mean of the last k checkpoints' weights, the mean of the last n checkpoints' scores,
   the held-out curve's last point and the mean of its last 4) is judged by the seed-to-seed noise it
   leaves, at its cost in full evaluations (``averaging.md``, ``averaging.csv``).
3. ``main``: ``python -m ccexp +sweep=decisive_study seed=0,...,N-1`` (seed outermost): the comparison.
4. ``decompose``: the same setup varying one source at a time, for random and uniform: the model's
   initialisation (``train.init_seed``), the data order (``sampler.seed``), the partition
   (``clusterer.seed``); and the held-out sample, by a paired bootstrap over the held-out documents of
   the main sweep's runs (``variance.md``, ``variance.csv``).
5. ``report``: the comparison report of the main sweep (verdict first), the curves, and ``study.json``.
6. ``budget``: noise against budget: random and uniform at 1x, 2x and 4x the study's budget (400, 800 and
   1,600 steps), 6 paired seeds each, two runs at a time (``hydra/launcher=packed``); per budget each sampler's
   seed SD, the paired difference's SD and effect, the seeds a ± 2 % CI needs and what that design costs,
   with the fitted exponent of noise against budget (``budget/``: ``README.md``, ``budget.csv``,
   ``budget.png`` and the sweep's own report).

Usage:
    python scripts/decisive_study.py                       # every step (about 4 hours on a 2-core CPU)
    python scripts/decisive_study.py --steps report        # redo the study files from the MLflow store
    python scripts/decisive_study.py --seeds 12 --jobs 2   # the main sweep's seeds; parallel processes
    python scripts/decisive_study.py --steps corpus,budget # noise against budget (about 2.5 hours, 2 cores)
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "decisive_study"
CORPUS = "data/debmix_decisive.jsonl.gz"


def build_corpus(src: Path, out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_builtin_corpus import OTHER_DOMAINS, PERMISSIVE_DOMAINS, build

    if out.is_file():
        print(f"study corpus: {out} (exists)", flush=True)
        return {}
    counts = build(src, out, rate=0.08, max_chars=2000, salt="ccexp-decisive-v1",
                   domains={**PERMISSIVE_DOMAINS, **OTHER_DOMAINS})
    print(f"study corpus: {sum(counts.values()):,} documents from {len(counts)} domains -> {out}", flush=True)
    return dict(counts.most_common())


def sweep(outputs: Path, name: str, overrides: list[str], jobs: int, packed: bool = False) -> None:
    """``python -m ccexp -m +sweep=decisive_study <overrides>`` into ``<outputs>/multirun/<name>`` (a folder
    launched before keeps its finished jobs); ``jobs`` > 1 runs them in parallel (joblib, or ``packed``:
    ccexp's launcher, ``jobs`` runs at once with the cores split between them)."""
    launcher = ([] if jobs <= 1 else ["hydra/launcher=packed", f"hydra.launcher.runs_per_device={jobs}"] if packed
                else ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"])
    cmd = [sys.executable, "-m", "ccexp", "-m", "+sweep=decisive_study", f"paths.outputs={outputs}", *launcher,
           *overrides, f"hydra.sweep.dir={outputs / 'multirun' / name}"]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


# -- scoring saved weights ----------------------------------------------------------------------------
class Scorer:
    """Scores weights of one sweep's configuration on the whole held-out split: per-document NLL,
    aggregated as the run does (:func:`ccexp.evaluation.perplexity.summarize`)."""

    def __init__(self, job_dir: Path):
        from omegaconf import OmegaConf

        from ccexp import stages
        from ccexp.artifacts import StageStore
        from ccexp.training import runner

        self.cfg = cfg = OmegaConf.load(job_dir / "resolved_config.yaml")
        stage = stages.Stages.for_config(cfg, StageStore(Path(cfg.paths.cache).resolve()))
        corpus = stage.corpus()
        clustering = stage.cluster(corpus, stage.embed(corpus))
        self.tokenized = stage.tokenize(corpus)
        self.split = stages.train_split(corpus, clustering, cfg.sampler.level)
        self.model = runner.build_model(cfg.model, cfg.trainer, self.tokenized, init_seed=cfg.train.init_seed)

    def nll(self, state: dict) -> tuple[np.ndarray, np.ndarray]:
        """Per held-out document: summed NLL (nats) and tokens, under ``state`` (the model's state dict)."""
        import torch

        from ccexp.evaluation.perplexity import document_nll

        self.model.load_state_dict(state)
        tok = self.tokenized.tokenizer
        with torch.no_grad():
            return document_nll(self.model, self.tokenized.tokens, self.tokenized.offsets, self.split.heldout_docs,
                                eos_id=self.tokenized.separator_id, pad_id=tok.pad_token_id,
                                max_tokens=self.cfg.eval.max_tokens, batch_size=64)

    def metrics(self, nll: np.ndarray, ntok: np.ndarray) -> dict[str, float]:
        from ccexp.evaluation.perplexity import summarize

        m = summarize(nll, ntok, self.split.labels[self.split.heldout_docs], self.split.num_clusters).metrics
        return {"ppl": m["ppl"], "ppl_macro": m["ppl_macro"]}


def model_state(path: Path, average: bool = False) -> dict:
    """The model's weights in a Lightning checkpoint (``average``: the averaged weights its WeightAverage
    callback saved)."""
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if average:
        state = ckpt["callbacks"]["WeightAverage"]["average"]
        return {k[len("module."):]: v for k, v in state.items() if k.startswith("module.")}
    return {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}


def averaging(outputs: Path, out: Path, sweeps: list[Path]) -> None:
    """Step 2's measurement (see the module docstring) over the runs of ``sweeps`` (sweep folders whose
    jobs kept a checkpoint every 20 steps)."""
    import torch

    from mlflow import MlflowClient

    torch.set_num_threads(1)
    jobs = sorted((p for s in sweeps for p in s.glob("*-s*-*") if (p / "checkpoints").is_dir()),
                  key=lambda p: p.name)
    client = MlflowClient(f"sqlite:///{(outputs / 'mlflow.db').resolve()}")
    scorer = Scorer(jobs[0])
    steps = int(scorer.cfg.train.steps)
    rows = []
    for job in jobs:
        ckpts = {int(p.stem.split("-")[1]): p for p in (job / "checkpoints").glob("step-*.ckpt")}
        every = min(ckpts)
        last = sorted(ckpts)[-10:]
        scores = {s: scorer.nll(model_state(ckpts[s])) for s in last}
        measures = {"last checkpoint": (scores[steps], 1), "EMA of the weights (span 10 %)": (
            scorer.nll(model_state(job / "checkpoints" / "last.ckpt", average=True)), 1)}
        for k in (2, 5, 10):
            mean = {key: torch.stack([model_state(ckpts[s])[key].float() for s in last[-k:]]).mean(0)
                    for key in model_state(ckpts[steps])}
            measures[f"mean of the last {k} checkpoints' weights ({k * every} steps)"] = (scorer.nll(mean), 1)
        by_metric = {}
        for n in (2, 5):
            per = [scorer.metrics(*scores[s]) for s in last[-n:]]
            by_metric[f"mean of the last {n} checkpoints' scores"] = ({m: float(np.mean([p[m] for p in per]))
                                                                       for m in ("ppl", "ppl_macro")}, n)
        run = json.loads((job / "run.json").read_text())["mlflow_run_id"]
        curve = {m: [p.value for p in sorted(client.get_metric_history(run, f"curve/{m}"), key=lambda p: p.step)]
                 for m in ("ppl", "ppl_macro")}
        sample = int(scorer.cfg.eval.curve_documents) / scorer.split.heldout_docs.size
        by_metric["held-out curve, last point"] = ({m: curve[m][-1] for m in curve}, sample)
        by_metric["held-out curve, mean of the last 4 points"] = ({m: float(np.mean(curve[m][-4:])) for m in curve},
                                                                 4 * sample)
        for name, (nll, cost) in measures.items():
            by_metric[name] = (scorer.metrics(*nll), cost)
        sampler, seed = job.name.split("-s")[0], int(job.name.split("-s")[1].split("-")[0])
        for name, (metrics, cost) in by_metric.items():
            rows.append({"sampler": sampler, "seed": seed, "measure": name, "cost_full_evals": cost, **metrics})
        print(f"averaging: scored {job.name}", flush=True)
    write_csv(out / "averaging.csv", rows)
    (out / "averaging.md").write_text(averaging_markdown(rows))


def noise_table(rows: list[dict], key: str, metric: str) -> dict:
    """For one measure: each sampler's seed-to-seed SD as a share of its mean, and the paired
    difference (uniform − random)'s SD as a share of random's mean."""
    by = {(r["sampler"], r["seed"]): r[metric] for r in rows if r["measure"] == key}
    samplers = sorted({s for s, _ in by})
    out = {}
    for s in samplers:
        v = np.array([by[s, k] for (t, k) in sorted(by) if t == s])
        out[f"sd_{s}"] = float(v.std(ddof=1) / v.mean())
        out[f"mean_{s}"] = float(v.mean())
    seeds = sorted({k for (s, k) in by if s == "random"} & {k for (s, k) in by if s == "uniform"})
    d = np.array([by["uniform", k] - by["random", k] for k in seeds])
    out["sd_diff"] = float(d.std(ddof=1) / np.mean([by["random", k] for k in seeds]))
    out["mean_diff"] = float(d.mean() / np.mean([by["random", k] for k in seeds]))
    return out


def averaging_markdown(rows: list[dict]) -> str:
    measures = list(dict.fromkeys(r["measure"] for r in rows))
    cost = {r["measure"]: r["cost_full_evals"] for r in rows}
    seeds = len({r["seed"] for r in rows})
    md = ["# Which held-out measure is least noisy at equal cost?", "",
          f"random and uniform, {seeds} seeds each (seed = initialisation and data order; one partition), the "
          "decisive study's setup with a checkpoint every 20 steps. Each measure scores the same runs; noise is the "
          "seed-to-seed standard deviation as a share of the mean, for each sampler and for the paired difference "
          "uniform − random (what a comparison's confidence interval is made of). Cost: full held-out evaluations "
          "per run (the curve scores a fixed sample of the held-out documents).", ""]
    for metric, title in (("ppl_macro", "macro perplexity (every cluster weighted equally)"),
                          ("ppl", "overall perplexity (token-weighted)")):
        md += [f"## {title}", "", "| measure | cost (full evals) | random: mean | random: seed SD | uniform: seed SD "
               "| uniform − random: mean | uniform − random: SD |", "|---|---:|---:|---:|---:|---:|---:|"]
        for m in measures:
            t = noise_table(rows, m, metric)
            md.append(f"| {m} | {cost[m]:.2g} | {t['mean_random']:.2f} | {t['sd_random']:.2%} | {t['sd_uniform']:.2%} "
                      f"| {t['mean_diff']:+.2%} | {t['sd_diff']:.2%} |")
        md.append("")
    return "\n".join(md)


# -- the variance decomposition ------------------------------------------------------------------------
SOURCES = {"init": ("initialisation (train.init_seed)", ["seed=0", "train.init_seed=0,1,2,3"]),
           "order": ("data order (sampler.seed)", ["train.init_seed=0", "seed=0,1,2,3"]),
           "partition": ("partition (clusterer.seed)", ["seed=0", "clusterer.seed=0,1,2,3"])}


def finished_jobs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.glob("*-s*-*") if (p / "status.json").is_file()
                  and json.loads((p / "status.json").read_text())["status"] == "FINISHED")


def job_metric(job: Path, client, metric: str) -> float:
    return client.get_run(json.loads((job / "run.json").read_text())["mlflow_run_id"]).data.metrics[metric]


def job_key(job: Path, varied: str) -> str:
    """The value of the setting a decomposition sweep varies, from the job's status (its overrides)."""
    overrides = json.loads((job / "status.json").read_text())["overrides"]
    key = {"init": "train.init_seed=", "order": "seed=", "partition": "clusterer.seed=", "main": "seed="}[varied]
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key))


def pairs(sweep_dir: Path, varied: str) -> dict[str, dict[str, Path]]:
    """{value of the varied setting: {sampler: job folder}} over the finished random and uniform jobs."""
    out: dict[str, dict[str, Path]] = {}
    for job in finished_jobs(sweep_dir):
        sampler = job.name.split("-s")[0]
        if sampler in ("random", "uniform"):
            out.setdefault(job_key(job, varied), {})[sampler] = job
    return {k: v for k, v in out.items() if len(v) == 2}


def bootstrap_sd(random_job: Path, uniform_job: Path, draws: int = 1000, seed: int = 0) -> dict[str, float]:
    """The SD of (uniform − random)'s macro and overall perplexity over resamples of the held-out documents
    (within each cluster, so every cluster keeps its count): the held-out sample's share of the noise."""
    def table(job: Path) -> dict[str, np.ndarray]:
        rows = list(csv.DictReader(open(job / "tables" / "heldout_documents.csv")))
        return {k: np.array([float(r[k]) for r in rows]) for k in ("document", "cluster", "tokens", "nll")}

    a, b = table(random_job), table(uniform_job)
    assert np.array_equal(a["document"], b["document"])
    rng = np.random.default_rng(seed)
    clusters = a["cluster"].astype(np.int64)
    k = int(clusters.max()) + 1
    members = [np.flatnonzero(clusters == c) for c in range(k)]
    out = {"ppl_macro": [], "ppl": []}
    for _ in range(draws):
        idx = np.concatenate([rng.choice(m, m.size) for m in members if m.size])
        ppl = []
        macro = []
        for t in (a, b):
            nll, tok, cl = t["nll"][idx], t["tokens"][idx], clusters[idx]
            ppl.append(math.exp(nll.sum() / tok.sum()))
            c_nll = np.bincount(cl, weights=nll, minlength=k)
            c_tok = np.bincount(cl, weights=tok, minlength=k)
            has = c_tok > 0
            macro.append(math.exp(float(np.mean(c_nll[has] / c_tok[has]))))
        out["ppl"].append((ppl[1] - ppl[0]) / ppl[0])
        out["ppl_macro"].append((macro[1] - macro[0]) / macro[0])
    return {m: float(np.std(v, ddof=1)) for m, v in out.items()}


def decompose(outputs: Path, out: Path, jobs: int) -> None:
    """Step 4 (see the module docstring): ``variance.md`` and ``variance.csv``."""
    from mlflow import MlflowClient

    for name, (_, overrides) in SOURCES.items():
        if len(finished_jobs(outputs / "multirun" / f"variance-{name}")) < 8:  # 4 values x 2 samplers
            sweep(outputs, f"variance-{name}", [*overrides, "sampler=random,uniform"], jobs)
    client = MlflowClient(f"sqlite:///{(outputs / 'mlflow.db').resolve()}")
    rows = []
    for name, (title, _) in [*SOURCES.items(), ("main", ("initialisation and data order together (seed)", []))]:
        found = pairs(outputs / "multirun" / (f"variance-{name}" if name != "main" else "main"), name)
        row = {"source": title, "runs_per_sampler": len(found)}
        for metric in ("eval/ppl_macro", "eval/ppl"):
            r = np.array([job_metric(p["random"], client, metric) for p in found.values()])
            u = np.array([job_metric(p["uniform"], client, metric) for p in found.values()])
            short = metric.split("/")[1]
            row[f"random_{short}_sd"] = float(r.std(ddof=1) / r.mean())
            row[f"uniform_{short}_sd"] = float(u.std(ddof=1) / u.mean())
            row[f"diff_{short}_sd"] = float((u - r).std(ddof=1) / r.mean())
        rows.append(row)
    main = pairs(outputs / "multirun" / "main", "main")
    boot = [bootstrap_sd(p["random"], p["uniform"]) for p in main.values()]
    rows.append({"source": "held-out sample (paired bootstrap over documents, within clusters)",
                 "runs_per_sampler": len(main), "random_ppl_macro_sd": math.nan, "uniform_ppl_macro_sd": math.nan,
                 "diff_ppl_macro_sd": float(np.mean([b["ppl_macro"] for b in boot])), "random_ppl_sd": math.nan,
                 "uniform_ppl_sd": math.nan, "diff_ppl_sd": float(np.mean([b["ppl"] for b in boot]))})
    write_csv(out / "variance.csv", rows)
    pct = lambda x: "—" if isinstance(x, float) and math.isnan(x) else f"{x:.2%}"  # noqa: E731
    md = ["# Where the noise comes from", "",
          "Each row varies one source and holds the others fixed (random and uniform, the study's setup); the "
          "figures are standard deviations over the runs as a share of the mean (for the difference: of random's "
          "mean). The last rows are the main sweep, where `seed` varies initialisation and data order together, "
          "and the held-out sample, by resampling the held-out documents of the main sweep's pairs.", "",
          "| source | runs per sampler | random macro ppl | uniform macro ppl | uniform − random, macro ppl | "
          "random ppl | uniform ppl | uniform − random, ppl |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['source']} | {r['runs_per_sampler']} | {pct(r['random_ppl_macro_sd'])} | "
                  f"{pct(r['uniform_ppl_macro_sd'])} | {pct(r['diff_ppl_macro_sd'])} | {pct(r['random_ppl_sd'])} | "
                  f"{pct(r['uniform_ppl_sd'])} | {pct(r['diff_ppl_sd'])} |")
    (out / "variance.md").write_text("\n".join(md) + "\n")


def report(outputs: Path, out: Path) -> None:
    """Step 5: the main sweep's comparison report (verdict first) and ``study.json``."""
    from mlflow import MlflowClient

    from ccexp.compare.report import write_report

    client = MlflowClient(f"sqlite:///{(outputs / 'mlflow.db').resolve()}")
    parent = json.loads((outputs / "multirun" / "main" / "sweep.json").read_text())["parent_run_id"]
    files, comparison = write_report(client, out_dir=out, parent_run_id=parent, experiment=EXPERIMENT,
                                     baseline="random", min_effect=0.02)
    rows, command = comparison.verdict()
    facts = {"parent_run_id": parent, "seeds": {g: comparison.seeds(g) for g in comparison.groups},
             "macro_ppl": {r.sampler: {"difference": r.rel_mean, "ci95_half_width": r.rel_half, "verdict": r.verdict,
                                       "pairs": r.n, "seeds_for_2pct_ci": r.seeds_half_width}
                           for r in rows if r.metric == "eval/ppl_macro"},
             "extend_command": command}
    (out / "study.json").write_text(json.dumps(facts, indent=2, default=str))
    seeds_plot(comparison, out / "seeds.png")
    print("study files:", ", ".join(str(p) for p in [*files, out / "seeds.png"]), flush=True)


def seeds_plot(comparison, path: Path, metric: str = "eval/ppl_macro", target: float = 0.02) -> None:
    """Each sampler's paired difference against random on ``metric`` (a share of random's mean) as seeds are
    added in order: the running mean and its 95 % CI, with the ± ``target`` band the study aims for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ccexp.compare.stats import mean_ci

    fig, ax = plt.subplots(figsize=(9, 4.5))
    base = {r.data.params["seed"]: r.data.metrics[metric] for r in comparison.groups["random"]}
    for i, g in enumerate(comparison.others):
        mine = {r.data.params["seed"]: r.data.metrics[metric] for r in comparison.groups[g]}
        seeds = sorted(mine.keys() & base.keys(), key=int)
        diffs = [(mine[s] - base[s]) / base[s] for s in seeds]
        n = np.arange(2, len(diffs) + 1)
        stats = np.array([mean_ci(diffs[:k]) for k in n])
        if not len(n):
            continue
        ax.plot(n, 100 * stats[:, 0], color=f"C{i + 1}", label=f"{g} − random")
        ax.fill_between(n, 100 * (stats[:, 0] - stats[:, 1]), 100 * (stats[:, 0] + stats[:, 1]), color=f"C{i + 1}",
                        alpha=0.15)
        ax.plot(np.arange(1, len(diffs) + 1), 100 * np.array(diffs), ".", color=f"C{i + 1}", alpha=0.5)
    ax.axhline(0, color="black", lw=0.8)
    for y in (-100 * target, 100 * target):
        ax.axhline(y, color="grey", ls="--", lw=0.8)
    ax.set(xlabel="paired seeds", ylabel=f"{metric.split('/')[-1]} difference, % of random",
           title=f"Paired difference as seeds are added: running mean and 95 % CI (dots: each seed; dashed: ± {target:.0%})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- noise against budget ------------------------------------------------------------------------------
BUDGET_SWEEP = ["seed=0,1,2,3,4,5", "train.steps=400,800,1600", "sampler=random,uniform"]
BUDGET_METRIC = "eval/ppl_macro"


def budget_rows(groups: dict[str, list], target: float = 0.02) -> list[dict]:
    """One row per budget (tokens per run) of the runs ``groups`` (sampler -> MLflow runs, random the baseline):
    each sampler's mean and seed SD (a share of its mean) of ``BUDGET_METRIC``, the paired difference uniform −
    random (a share of random's mean: effect, its 95 % CI, SD), the paired seeds a 95 % CI of ± ``target`` needs,
    and that design's CPU-hours (2 samplers x seeds runs at this budget's measured tokens/s and time outside
    training, one after another); ``measured_cpu_hours``: what this budget's runs took (their total seconds)."""
    from scipy import stats

    from ccexp.compare.budget import throughput
    from ccexp.compare.stats import mean_ci, sample_sd, seeds_for_half_width

    def at(runs: list, tokens: int) -> dict[str, object]:
        return {r.data.params["seed"]: r for r in runs if int(round(r.data.metrics.get("train/tokens", 0))) == tokens}

    rows = []
    for tokens in sorted({int(round(r.data.metrics["train/tokens"])) for r in groups["random"]}):
        base, mine = at(groups["random"], tokens), at(groups["uniform"], tokens)
        seeds = sorted(base.keys() & mine.keys(), key=int)
        r = np.array([base[k].data.metrics[BUDGET_METRIC] for k in seeds])
        u = np.array([mine[k].data.metrics[BUDGET_METRIC] for k in seeds])
        d = (u - r) / r.mean()
        effect, half = mean_ci(d)
        sd = sample_sd(d)
        runs = [*base.values(), *mine.values()]
        rate, extra = throughput(runs)
        need = seeds_for_half_width(sd, target)
        dof = len(seeds) - 1
        sd_lo, sd_hi = (sd * math.sqrt(dof / stats.chi2.ppf(q, dof)) for q in (0.975, 0.025))
        rows.append({"tokens": tokens, "steps": int(base[seeds[0]].data.params["train.steps"]), "seeds": len(seeds),
                     "random_mean": float(r.mean()), "random_seed_sd": sample_sd(r) / float(r.mean()),
                     "uniform_mean": float(u.mean()), "uniform_seed_sd": sample_sd(u) / float(u.mean()),
                     "effect": effect, "effect_ci95": half, "diff_sd": sd, "diff_sd_lo": sd_lo, "diff_sd_hi": sd_hi,
                     "seeds_for_2pct": need, "seeds_for_2pct_lo": seeds_for_half_width(sd_lo, target),
                     "seeds_for_2pct_hi": seeds_for_half_width(sd_hi, target),
                     "tokens_per_s": rate, "cpu_hours_for_2pct": 2 * need * (tokens / rate + extra) / 3600,
                     "measured_cpu_hours": sum(x.data.metrics.get("time/total_seconds", 0.0) for x in runs) / 3600})
    return rows


def budget(outputs: Path, out: Path, jobs: int) -> None:
    """Step 6 (see the module docstring): ``budget/README.md``, ``budget.csv``, ``budget.png`` and the budget
    sweep's comparison report (whose "Budget and seeds" section fits and designs with ccexp's own code)."""
    from mlflow import MlflowClient

    from ccexp.compare.budget import fit_line
    from ccexp.compare.report import by_arm, collect, write_report

    sweep_dir = outputs / "multirun" / "budget"
    if len(finished_jobs(sweep_dir)) < 36:  # 6 seeds x 3 budgets x 2 samplers
        sweep(outputs, "budget", BUDGET_SWEEP, jobs, packed=True)
    client = MlflowClient(f"sqlite:///{(outputs / 'mlflow.db').resolve()}")
    parent = json.loads((sweep_dir / "sweep.json").read_text())["parent_run_id"]
    files, comparison = write_report(client, out_dir=out, parent_run_id=parent, experiment=EXPERIMENT,
                                     baseline="random", min_effect=0.02)
    runs = collect(client, parent_run_id=parent, experiment=EXPERIMENT)
    rows = budget_rows(by_arm(runs, "sampler"))
    write_csv(out / "budget.csv", rows)
    study = comparison.budgets
    noise = study.noise.get("uniform")
    seed_fits = {g: fit_line(np.log([r["tokens"] for r in rows]), np.log([r[f"{g}_seed_sd"] for r in rows]))
                 for g in ("random", "uniform")}
    commits = sorted({r.data.tags.get("mlflow.source.git.commit", "?")[:7] for r in runs})
    budget_plot(rows, noise, out / "budget.png", commits)
    slope = lambda f: (f"{f.slope:+.2f} ± {f.half:.2f}" if f.half is not None else f"{f.slope:+.2f}")  # noqa: E731
    md = ["# Noise against budget: random vs uniform at 1x, 2x and 4x the decisive study's tokens", "",
          f"Runs of commit{'s' if len(commits) > 1 else ''} {', '.join(f'`{c}`' for c in commits)} (the MLflow runs' "
          "`mlflow.source.git.commit`), made with `python scripts/decisive_study.py --steps corpus,budget`: the "
          "decisive study's setup (`+sweep=decisive_study`: the same corpus, partition, tiny GPT and 4,096 tokens per "
          f"step) with `{' '.join(BUDGET_SWEEP)}`, two runs at a time on one CPU thread each "
          "(`hydra/launcher=packed`). Every figure is on held-out macro perplexity (clusters weighted equally); SDs "
          "and effects are shares of the mean (the difference's: of random's mean at that budget).", "",
          "| tokens per run | steps | paired seeds | random: macro ppl | random: seed SD | uniform: seed SD | "
          "uniform − random (95 % CI) | SD of the paired difference (95 % CI) | seeds for ± 2 % (at the SD's CI) | "
          "CPU-hours for that design "
          "| tokens/s per run | CPU-hours measured here |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['tokens']:,} | {r['steps']:,} | {r['seeds']} | {r['random_mean']:.1f} | "
                  f"{r['random_seed_sd']:.2%} | {r['uniform_seed_sd']:.2%} | {r['effect']:+.2%} ± "
                  f"{r['effect_ci95']:.2%} | {r['diff_sd']:.2%} ({r['diff_sd_lo']:.2%}–{r['diff_sd_hi']:.2%}) | "
                  f"{r['seeds_for_2pct']:,} ({r['seeds_for_2pct_lo']:,}–{r['seeds_for_2pct_hi']:,}) | "
                  f"{r['cpu_hours_for_2pct']:,.1f} | {r['tokens_per_s']:,.0f} | {r['measured_cpu_hours']:.2f} |")
    md += ["", "Fitted in log–log over the budgets (SD ∝ budget^b, 95 % CI of b from Student's t with "
           f"{len(rows) - 2} degree{'s' if len(rows) != 3 else ''} of freedom): paired difference b = "
           f"{slope(noise) if noise else 'not fitted'}; random's seed SD b = {slope(seed_fits['random'])}; "
           f"uniform's b = {slope(seed_fits['uniform'])}. b = −0.5 would be noise falling as the square root of the "
           "tokens (Heineman et al. 2025 find noise falling with scale).", "",
           "![noise and seeds needed against budget](budget.png)", "",
           "The sweep's own report ([report.md](report.md), [report.html](report.html)) compares the samplers at "
           "the largest budget and, in its section \"Budget and seeds\", fits the same runs with ccexp's "
           "`ccexp.compare.budget` and names the cheapest design and the command that runs it in the same sweep "
           "folder; that section is copied here:", ""]
    text = (out / "report.md").read_text()
    section = text[text.index("## Budget and seeds"):]
    section = section[:section.find("\n## ", 3) if section.find("\n## ", 3) > 0 else len(section)]
    md += [line.replace("## ", "### ", 1) if line.startswith("## ") else line for line in section.splitlines()
           if not line.startswith("Note: the verdict compares")]  # the report's note on its verdict, not shown here
    (out / "README.md").write_text("\n".join(md).rstrip() + "\n")
    print("budget files:", ", ".join(str(p) for p in [*files, out / "README.md", out / "budget.csv",
                                                      out / "budget.png"]), flush=True)


def budget_plot(rows: list[dict], noise, path: Path, commits: list[str], target: float = 0.02) -> None:
    """Two log–log panels against tokens per run: the seed SDs and the paired difference's SD with its fitted
    line (and the lines at the ends of b's 95 % CI, through the same centre); the paired seeds a ± ``target``
    CI needs, measured at each budget and as the fit carries them to 2x and 4x the largest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from ccexp.compare.stats import seeds_for_half_width

    tokens = np.array([r["tokens"] for r in rows], dtype=float)
    far = np.geomspace(tokens[0], tokens[-1] * 4, 50)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for key, label, style in (("random_seed_sd", "random: seed SD", "o--"), ("uniform_seed_sd", "uniform: seed SD",
                                                                              "s--")):
        a.plot(tokens / 1e6, [100 * r[key] for r in rows], style, label=label, alpha=0.7)
    sd = np.array([[r["diff_sd"], r["diff_sd_lo"], r["diff_sd_hi"]] for r in rows]) * 100
    a.errorbar(tokens / 1e6, sd[:, 0], yerr=[sd[:, 0] - sd[:, 1], sd[:, 2] - sd[:, 0]], fmt="D", color="C2",
               capsize=3, label="uniform − random: SD of the paired difference (95 % CI)")
    if noise is not None:
        line = lambda s: np.exp(noise.intercept + s * np.log(far) + (noise.slope - s) * np.log(tokens).mean())  # noqa: E731
        a.plot(far / 1e6, 100 * line(noise.slope), color="C2", lw=1, label=f"fit: SD ∝ budget^{noise.slope:+.2f}")
        if noise.half is not None:
            for s in (noise.slope - noise.half, noise.slope + noise.half):
                a.plot(far / 1e6, 100 * line(s), color="C2", lw=0.6, ls=":",
                       label="b at the ends of its 95 % CI" if s < noise.slope else None)
    shown = np.concatenate([sd.ravel(), [100 * r[k] for r in rows for k in ("random_seed_sd", "uniform_seed_sd")]])
    a.set_ylim(shown.min() / 1.5, shown.max() * 1.5)  # the lines at the ends of b's CI leave the plot, not stretch it
    a.set(xscale="log", yscale="log", xlabel="tokens per run (millions)", ylabel="SD, % of the mean",
          title="Seed-to-seed noise of held-out macro ppl")
    a.legend(fontsize=7, loc="lower right")
    need = np.array([[r["seeds_for_2pct"], r["seeds_for_2pct_lo"], r["seeds_for_2pct_hi"]] for r in rows])
    b.errorbar(tokens / 1e6, need[:, 0], yerr=[need[:, 0] - need[:, 1], need[:, 2] - need[:, 0]], fmt="D",
               color="C2", capsize=3, label="at the measured noise (at its 95 % CI)")
    if noise is not None:
        b.plot(far / 1e6, [seeds_for_half_width(float(np.exp(noise.intercept + noise.slope * np.log(t))), target)
                           for t in far], color="C2", lw=1, ls="--",
               label="at the fitted noise (to 4x the largest budget)")
    for r in rows:
        b.annotate(f"{r['cpu_hours_for_2pct']:,.0f} CPU-h", (r["tokens"] / 1e6, r["seeds_for_2pct"]),
                   textcoords="offset points", xytext=(4, 6), fontsize=8)
    b.set(xscale="log", yscale="log", xlabel="tokens per run (millions)", ylabel="paired seeds",
          title=f"Seeds for a 95 % CI of ± {target:.0%} (labels: CPU-hours)")
    b.legend(fontsize=8)
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    sparse = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "125" else "")
    for ax in (a, b):
        ax.grid(alpha=0.3, which="both")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(sparse)
    fig.suptitle(f"Decisive study corpus, random vs uniform, {rows[0]['seeds']}+ paired seeds per budget "
                 f"(commit {', '.join(commits)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


STEPS = ("corpus", "averaging", "main", "decompose", "report", "budget")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=ROOT.parent / "shared" / "data" / "debmix")
    ap.add_argument("--outputs", type=Path, default=ROOT / "outputs")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "studies" / "decisive")
    ap.add_argument("--steps", default="corpus,averaging,main,decompose,report",
                    help=f"comma-separated, of: {', '.join(STEPS)}")
    ap.add_argument("--seeds", type=int, default=12, help="seeds of the main sweep")
    ap.add_argument("--jobs", type=int, default=2, help="sweep jobs run at once (each on one CPU thread)")
    ap.add_argument("--averaging-from", type=Path, nargs="*", default=None,
                    help="measure averaging on these sweep folders (with checkpoints) instead of running its sweep")
    args = ap.parse_args()
    steps = args.steps.split(",")
    unknown = [s for s in steps if s not in STEPS]
    if unknown:  # a misspelt step would otherwise do nothing, silently
        ap.error(f"unknown step(s) {', '.join(unknown)}: the steps are {', '.join(STEPS)}")
    outputs = args.outputs.resolve()
    if "corpus" in steps:
        if not (args.src / "MANIFEST.json").is_file():
            sys.exit(f"no debmix corpus at {args.src}: the study needs the team's corpus (--src)")
        build_corpus(args.src, outputs / CORPUS)
    if "averaging" in steps:
        if not args.averaging_from:
            sweep(outputs, "averaging", ["seed=0,1,2,3,4,5", "sampler=random,uniform",
                                         "train.checkpoint_every_n_steps=20"], args.jobs)
        averaging(outputs, args.out, args.averaging_from or [outputs / "multirun" / "averaging"])
    if "main" in steps:
        sweep(outputs, "main", [f"seed={','.join(map(str, range(args.seeds)))}"], args.jobs)
    if "decompose" in steps:
        decompose(outputs, args.out, args.jobs)
    if "report" in steps:
        report(outputs, args.out)
    if "budget" in steps:
        budget(outputs, args.out / "budget", args.jobs)


if __name__ == "__main__":
    main()
