"""The first run a newcomer makes, ``python -m ccexp``, phase by phase: today's default against the default
before the first-run work (the baseline: commit e6b2dd2, run from a git worktree of it), in one run of this
script, each from an empty outputs folder, with this checkout's venv.

Prints each phase's seconds and share (embed and train from each job's own log lines, the rest as "other";
the default's full breakdown from its ``timing.json``: start, corpus+tokenize, embed, cluster+sampler, train,
eval, reports), the totals (the processes' wall time) and their ratio; then how much of the clustering the
new embedding settings keep: the adjusted Rand index (ARI) between the default's and the baseline's K-means
partitions, next to the ARI between two seeds of K-means on the baseline's own embeddings (what "the same
clustering" can mean at all).

The baseline's settings: float32 embeddings of 256 tokens, 1,000 steps (2.05 M tokens); today's: ``embedder.dtype=auto``
(bfloat16 only where the CPU computes it natively), 128 tokens (all-MiniLM-L6-v2's training length), each shard
embedded in length order, 400 steps. Writes ``docs/measured/first_run.json`` (``--write``), the single source
of the figures the README and docs/using.md state (tests/test_docs_figures.py checks them).

Usage:
    python benches/bench_first_run.py [--write]      # about 12 minutes on an idle 2-core CPU
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BASELINE_REV = "e6b2dd2"  # the last commit before the first-run work (issue 32)
KEPT = ("wall_seconds", "phases", "eval_line", "ppl", "ppl_macro", "steps", "tokens", "embed_docs_per_s",
        "train_tokens_per_s", "timing")


def job(src: Path, outputs: Path, overrides: list[str]) -> dict:
    """Run ``python -m ccexp`` from the source tree ``src`` into ``outputs``; its wall time, its phases (embed
    and train from its log, the rest as other), its held-out figures and, where it writes one, its timing.json."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ccexp", f"paths.outputs={outputs}", *overrides], cwd=src,
                          capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"})  # its own store
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"bench_first_run: python -m ccexp {' '.join(overrides)} in {src} failed:\n{done.stdout[-2000:]}"
                 f"{done.stderr[-2000:]}")
    lines = done.stdout.splitlines() + done.stderr.splitlines()

    def find(pattern: str) -> re.Match:
        return next(m for ln in lines if (m := re.search(pattern, ln)))

    embed = find(r" - embed: [\d,]+ docs, .*?([\d.]+) docs/s when computed, .*reused=(\w+), ([\d.]+) s")
    train = find(r" - done: .* \(train ([\d.]+) s, ([\d.]+) tokens/s\)")
    ev = find(r" - (eval \(final weights\): held-out ppl ([\d.]+), macro ([\d.]+).*)")
    steps = find(r" - train: (\d+) steps x [\d,]+ tokens = ([\d,]+) tokens")
    phases = {"embed": float(embed.group(3)), "train": float(train.group(1))}
    phases["other"] = wall - sum(phases.values())
    run = Path(find(r"outputs in (\S+?);?(?: |$)").group(1).rstrip(";"))
    timing = json.loads((run / "timing.json").read_text()) if (run / "timing.json").is_file() else None
    prefix = find(r" - cluster: K=\d+.*fingerprint (\w+)").group(1)  # the stage's folder in the cache
    (cluster,) = (outputs / "cache" / "cluster").glob(f"{prefix}*/level0_labels.npy")
    return {"wall_seconds": wall, "phases": phases, "eval_line": ev.group(1), "ppl": float(ev.group(2)),
            "ppl_macro": float(ev.group(3)), "steps": int(steps.group(1)), "tokens": int(steps.group(2).replace(",", "")),
            "embed_docs_per_s": float(embed.group(1)), "train_tokens_per_s": float(train.group(2)), "timing": timing,
            "labels": str(cluster), "embed_reused": embed.group(2) == "True"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write docs/measured/first_run.json")
    args = parser.parse_args()
    from sklearn.metrics import adjusted_rand_score

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "baseline-src"
        subprocess.run(["git", "worktree", "add", "--detach", str(src), BASELINE_REV], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            base = job(src, Path(tmp) / "baseline", [])
            # K-means with another seed on the baseline's embeddings (cached): the floor of "the same clustering"
            floor = job(src, Path(tmp) / "baseline", ["clusterer.seed=1", "train.steps=1"])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(src)], cwd=ROOT, capture_output=True)
        new = job(ROOT, Path(tmp) / "default", [])
        labels = {name: np.load(t["labels"]) for name, t in (("base", base), ("floor", floor), ("new", new))}
    ari = float(adjusted_rand_score(labels["base"], labels["new"]))
    ari_floor = float(adjusted_rand_score(labels["base"], labels["floor"]))
    ratio = new["wall_seconds"] / base["wall_seconds"]
    print(f"{'phase':<16} {'baseline s':>10} {'default s':>10} {'ratio':>7}  share of the default")
    for phase in ("embed", "train", "other"):
        b, n = base["phases"][phase], new["phases"][phase]
        print(f"{phase:<16} {b:>10.1f} {n:>10.1f} {n / b:>7.2f}  {100 * n / new['wall_seconds']:.0f}%")
    print(f"{'total (wall)':<16} {base['wall_seconds']:>10.1f} {new['wall_seconds']:>10.1f} {ratio:>7.2f}")
    print("the default's own breakdown: " + ", ".join(f"{k} {v:.1f} s" for k, v in new["timing"]["seconds"].items()))
    print(f"throughput: embed {base['embed_docs_per_s']:.0f} -> {new['embed_docs_per_s']:.0f} docs/s, train "
          f"{base['train_tokens_per_s']:.0f} -> {new['train_tokens_per_s']:.0f} tokens/s")
    print(f"clustering kept: ARI(default, baseline) = {ari:.3f}; ARI(baseline, baseline with clusterer.seed=1) = "
          f"{ari_floor:.3f}")
    print(f"baseline: {base['eval_line']}\ndefault:  {new['eval_line']}")
    import torch

    cpu = {"cpus": os.cpu_count(), "capability": torch.backends.cpu.get_cpu_capability(),
           "embedder_dtype": __import__("ccexp.embedding.sentence", fromlist=["x"]).resolve_dtype("auto", "cpu")}
    print(f"this machine: {cpu}")
    if args.write:
        out = ROOT / "docs" / "measured" / "first_run.json"
        out.parent.mkdir(exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        out.write_text(json.dumps({
            "bench": "benches/bench_first_run.py", "commit": commit, "baseline_commit": BASELINE_REV, **cpu,
            "measured": time.strftime("%Y-%m-%d"),
            "baseline": {k: base[k] for k in KEPT},
            "default": {k: new[k] for k in KEPT},
            "ratio": ratio, "ari_default_vs_baseline": ari, "ari_kmeans_seed": ari_floor}, indent=1) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
