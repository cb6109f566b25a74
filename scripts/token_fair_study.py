"""The token-fair sampler study, end to end: corpus, sweep, report and plots into ``docs/studies/token_fair/``.

1. Builds the study corpus from the team's debmix corpus (all 11 domains, every domain sampled at the
   same rate so the imbalance is kept, documents cut at 4,000 characters) into
   ``<outputs>/data/debmix_study.jsonl.gz``; without ``--src`` present it falls back to ccexp's embedded
   corpus (and says so).
2. Runs ``python -m ccexp +sweep=token_fair_study`` (random, uniform, ClusterClip, dynamic x 3 seeds at
   one equal token budget; see ``sweeps/token_fair_study.yaml``).
3. Writes the comparison report of that sweep with paired differences against random
   (:mod:`ccexp.report`), the held-out curves against tokens trained (``curves.png``) and the per-domain
   paired differences (``domains.png``) into ``--out``.

Usage:
    python scripts/token_fair_study.py                      # about 1-2 hours on a 2-core CPU
    python scripts/token_fair_study.py --report-only        # redo step 3 from the MLflow store
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "token_fair_study"


def build_corpus(src: Path, out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_builtin_corpus import OTHER_DOMAINS, PERMISSIVE_DOMAINS, build

    counts = build(src, out, rate=0.15, max_chars=4000, salt="ccexp-study-v1",
                   domains={**PERMISSIVE_DOMAINS, **OTHER_DOMAINS})
    print(f"study corpus: {sum(counts.values()):,} documents from {len(counts)} domains -> {out}", flush=True)
    return dict(counts.most_common())


def domains_plot(paired_csv: Path, path: Path) -> None:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in csv.DictReader(open(paired_csv)) if r["metric"].startswith("eval/ppl_domain/")]
    samplers = sorted({r["sampler"] for r in rows})
    color = {s: f"C{i}" for i, s in enumerate(sorted(samplers + [rows[0]["baseline"]]))}  # as in curves.png
    domains = sorted({r["metric"].split("/")[-1] for r in rows})
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / max(1, len(samplers))
    for i, s in enumerate(samplers):
        got = {r["metric"].split("/")[-1]: r for r in rows if r["sampler"] == s}
        mean = [float(got[d]["mean_difference"]) if d in got else math.nan for d in domains]
        half = [float(got[d]["ci95_half_width"]) if d in got else 0.0 for d in domains]
        ax.bar(np.arange(len(domains)) + (i - (len(samplers) - 1) / 2) * width, mean, width, yerr=half, capsize=3,
               color=color[s], label=s)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(np.arange(len(domains)), domains, rotation=30, ha="right")
    ax.set(ylabel="held-out perplexity − random's (same seed)",
           title=f"{EXPERIMENT}: per-domain paired difference against random (mean ± 95 % CI over seeds; < 0 = better)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=ROOT.parent / "shared" / "data" / "debmix")
    ap.add_argument("--outputs", type=Path, default=ROOT / "outputs")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "studies" / "token_fair")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    facts: dict = {}
    if not args.report_only:
        corpus = args.outputs / "data" / "debmix_study.jsonl.gz"
        overrides = [f"paths.outputs={args.outputs}"]
        if (args.src / "MANIFEST.json").is_file():
            facts["corpus_documents_per_domain"] = build_corpus(args.src, corpus)
        else:
            print(f"no debmix corpus at {args.src}: the study runs on ccexp's embedded corpus instead", flush=True)
            overrides += ["data=builtin"]
            facts["corpus"] = "builtin"
        cmd = [sys.executable, "-m", "ccexp", "+sweep=token_fair_study", *overrides]
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
        (args.out / "study.json").write_text(json.dumps(facts, indent=2))

    from mlflow import MlflowClient

    from ccexp.compare.report import latest_sweep, write_report

    client = MlflowClient(f"sqlite:///{(args.outputs / 'mlflow.db').resolve()}")
    parent = latest_sweep(client, EXPERIMENT)
    files, _ = write_report(client, out_dir=args.out, parent_run_id=parent, experiment=EXPERIMENT, baseline="random")
    domains_plot(args.out / "paired.csv", args.out / "domains.png")  # curves.png is the report's
    print("study files:", ", ".join(str(p.relative_to(ROOT)) for p in [*files, args.out / "domains.png"]))


if __name__ == "__main__":
    main()
