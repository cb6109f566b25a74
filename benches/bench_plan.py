"""The stream plan's speed (issue: 100M documents, 10,000 clusters, 10,000 steps in under a minute
on the 2-core machine), as the ratio of each size to the 1M-document baseline run in this process.

    .venv/bin/python benches/bench_plan.py [--documents 100000000] [--steps 10000]

Each run: a synthetic Zipf corpus (K=10,000, log-normal lengths, mean 500 tokens), ClusterClip
(M=5, reset) and 1,048,576 tokens per step (512 rows of 2,048): corpus build, sampler build and
simulation timed apart.
"""
from __future__ import annotations

import argparse
import resource
import time

from ccexp.data.packing import stream_lengths
from ccexp.data.simulate import simulate, synthetic_corpus
from ccexp.sampling import ClusterClipSampler


def one(documents: int, steps: int, clusters: int = 10_000) -> dict[str, float]:
    t0 = time.perf_counter()
    labels, sizes, lengths = synthetic_corpus(clusters, documents, zipf=1.0, mean_tokens=500)
    t1 = time.perf_counter()
    sampler = ClusterClipSampler(labels, sizes, block_size=2048, seed=0, document_tokens=stream_lengths(lengths, None),
                                 clip_threshold=5, on_exhausted="reset")
    t2 = time.perf_counter()
    plan = simulate(sampler, lengths, steps=steps, tokens_per_step=1_048_576, seq_len=2048, record_every=100)
    t3 = time.perf_counter()
    return {"corpus_s": t1 - t0, "sampler_s": t2 - t1, "simulate_s": t3 - t2, "total_s": t3 - t0,
            "clipped": int((plan.clipped_at >= 0).sum()), "tokens": int(plan.tokens.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, default=100_000_000)
    ap.add_argument("--steps", type=int, default=10_000)
    args = ap.parse_args()
    base = one(1_000_000, args.steps)
    big = one(args.documents, args.steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    for name, r in (("1M (baseline)", base), (f"{args.documents / 1e6:g}M", big)):
        print(f"{name:>14}: corpus {r['corpus_s']:6.1f} s, sampler {r['sampler_s']:6.1f} s, simulate "
              f"{r['simulate_s']:6.1f} s, total {r['total_s']:6.1f} s; {r['tokens']:,} tokens, {r['clipped']:,} "
              "clusters clipped")
    print(f"ratio total {big['total_s'] / base['total_s']:.2f}x, simulate {big['simulate_s'] / base['simulate_s']:.2f}x "
          f"for {args.documents / 1e6:g}x the documents; peak RSS {rss:.1f} GiB")


if __name__ == "__main__":
    main()
