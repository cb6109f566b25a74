"""How small can the flat-memory test be (issue 57, step 3)? The corpus and tokenize stages' peak RSS at several
corpus sizes, each measured in ``--runs`` fresh processes with fresh caches, exactly as
``tests/test_preprocess_scale.py::test_corpus_and_tokenize_peak_memory_is_flat_in_the_number_of_documents`` does
(its ``run_stages``: synthetic Parquet documents of 8-40 Zipf words, ``data.shard_documents=50000``).

For each pair of sizes ``small < large`` it reports what the test would see: the ratio the test computes (the
smaller of two runs at the large size over one run at the small size, over every such draw of the runs measured),
its largest value without any growth (a false alarm above the threshold), and its smallest value had the stages
held ``--leak`` bytes per document (the growth the test guards against, added to each measured peak). The pair
shows the property when the first stays below the test's threshold and the second above it.

Usage:
    python benches/bench_flat_memory.py                       # 250k, 500k, 1M documents x 5 runs (~15 min, 2 cores)
    python benches/bench_flat_memory.py --sizes 250000 1000000 --runs 3 --leak 64
Writes ``docs/measured/flat_memory.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def measure(sizes: list[int], runs: int) -> dict[int, list[float]]:
    """Peak RSS (MiB) of each run of each size, the sizes interleaved run by run (a machine that slows down
    or warms up affects every size alike)."""
    from test_preprocess_scale import run_stages

    peaks: dict[int, list[float]] = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(runs):
            for n in sizes:
                t0 = time.perf_counter()
                row = run_stages(Path(tmp), n, tag=f"-{r}")
                assert row["documents"] == n
                peaks[n].append(row["peak_mib"])
                print(f"run {r + 1}/{runs}: {n:>9,} documents: peak RSS {row['peak_mib']:.0f} MiB "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return peaks


def draw_ratios(peaks: dict[int, list[float]], small: int, large: int, leak_bytes: float) -> dict:
    """The test's ratio min(two large runs) / (one small run) over every draw of the measured runs, as
    measured and with ``leak_bytes`` per document added to each peak."""
    mib = leak_bytes / 2**20

    def ratios(extra: float) -> list[float]:
        return [min(a, b) / s for a, b in itertools.combinations([p + extra * large for p in peaks[large]], 2)
                for s in [p + extra * small for p in peaks[small]]]

    flat, leaking = ratios(0.0), ratios(mib)
    return {"small": small, "large": large, "flat_max": max(flat), "flat_median": statistics.median(flat),
            "leak_min": min(leaking), "leak_median": statistics.median(leaking)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[250_000, 500_000, 1_000_000])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--leak", type=float, default=64.0, help="bytes per document the test must catch (default 64)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "measured" / "flat_memory.json")
    args = ap.parse_args()
    peaks = measure(sorted(args.sizes), args.runs)
    for n, ps in peaks.items():
        print(f"{n:>9,} documents: peak RSS MiB mean {statistics.mean(ps):.0f}, sd {statistics.stdev(ps):.1f}, "
              f"min {min(ps):.0f}, max {max(ps):.0f} ({len(ps)} runs)")
    pairs = [draw_ratios(peaks, a, b, args.leak) for a, b in itertools.combinations(sorted(peaks), 2)]
    for p in pairs:
        print(f"{p['large']:>9,} / {p['small']:<9,}: ratio without growth at most {p['flat_max']:.3f} (median "
              f"{p['flat_median']:.3f}); with {args.leak:.0f} B/document at least {p['leak_min']:.3f} (median "
              f"{p['leak_median']:.3f})")
    args.out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d"), "runs": args.runs,
                                    "leak_bytes_per_document": args.leak, "peaks_mib": {str(k): v for k, v in
                                                                                        peaks.items()},
                                    "pairs": pairs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
