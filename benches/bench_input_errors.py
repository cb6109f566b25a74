"""How soon bad input is answered: ``python -m ccexp`` with a corpus path that does not exist, a misspelt
setting and a budget ClusterClip cannot supply, each timed as a user runs it (a fresh process, wall
clock to the one error line), against a baseline in the same process's turn order: a fresh process
that only starts Python and imports torch and Lightning (what every run pays before training).

Checks that need only the config and the file system (:func:`ccexp.preflight.check_inputs`) run before
torch is imported, so a wrong path or key is answered in about the time Python takes to start; the
budget check needs the tokenized corpus and answers before the embedding (it is timed on the
round-3 cases' tiny corpus, whose stages are computed in the first round and cached after).
Rounds alternate the commands so other load on the machine hits each alike; the median is printed
with its ratio to the baseline (goal for the path and key errors: well under 5 s on an idle laptop).

Usage:
    python benches/bench_input_errors.py              # 5 rounds
    python benches/bench_input_errors.py --rounds 9
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "cases" / "tiny.jsonl"


def timed(args: list[str], cwd: Path) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"status {proc.returncode}"]
    return seconds, last[0][:110]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        commands = {
            "baseline: python + import torch, lightning": ["-c", "import torch, lightning"],
            "missing data.path": ["-m", "ccexp", "data=jsonl", "data.path=/nowhere/corpus.jsonl",
                                  f"paths.outputs={out}"],
            "misspelt setting (trian.steps)": ["-m", "ccexp", "trian.steps=3", f"paths.outputs={out}"],
            "budget ClusterClip cannot supply": ["-m", "ccexp", "data=jsonl", f"data.path={TINY}",
                                                 "data.label_fields=[domain]", "model.tokenizer.vocab_size=512",
                                                 "sampler=clusterclip", "sampler.clip_threshold=1",
                                                 "train.steps=100000", f"paths.outputs={out}"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        lines: dict[str, str] = {}
        for r in range(args.rounds + 1):  # round 0 warms the file cache and computes the tiny corpus's stages
            for name, command in commands.items():
                seconds, lines[name] = timed(command, ROOT)
                if r:
                    times[name].append(seconds)
        base = statistics.median(times[next(iter(commands))])
        print(f"{'command':<44} {'median s':>9} {'x baseline':>11}  last line")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<44} {med:9.2f} {med / base:11.2f}  {lines[name]}")


if __name__ == "__main__":
    main()
