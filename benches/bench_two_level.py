"""Two-level vs flat k-means at scale: wall time and objective in one run (issue 14).

Clusters N synthetic unit vectors (a Zipf-weighted mixture of unit-norm Gaussians, as in
``bench_embed_cluster.py``: MiniLM at ~90 docs/s cannot embed 1M documents on a laptop CPU) into K
clusters with flat FAISS k-means (``clusterer=kmeans``) and with ``clusterer=two_level`` (√K
coarse cells, proportional fine k-means, inverted-file assignment), the same Lloyd iteration count
for both. Prints each one's wall time (training and the assignment of every vector), the inertia
(mean squared L2 distance to the assigned centroid, lower is better), the mean cosine similarity,
and the ratios two-level/flat.

Usage:
    python benches/bench_two_level.py                                   # the issue's setting: 1M x 384, K=10,000, 20 iterations
    python benches/bench_two_level.py --vectors 200000 --k 2000 --niter 10   # quick
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_embed_cluster import inertia, mixture  # noqa: E402


def main() -> None:
    from ccexp.clustering.kmeans import FaissKMeans
    from ccexp.clustering.two_level import TwoLevelKMeans

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vectors", type=int, default=1_000_000)
    ap.add_argument("--k", type=int, default=10_000)
    ap.add_argument("--niter", type=int, default=20)
    ap.add_argument("--nprobe", default="1,3", help="two-level assignment: coarse cells probed (comma list)")
    ap.add_argument("--skip-flat", action="store_true", help="time the two-level clusterer alone")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its "could not load AVX512" lines are not errors
    import faiss

    print(f"FAISS {faiss.__version__}, {faiss.omp_get_max_threads()} threads; {args.vectors:,} x 384 unit vectors "
          f"(synthetic mixture of {max(50, args.k // 20)} Gaussians), K={args.k:,}, {args.niter} iterations", flush=True)
    x = mixture(args.vectors, 384, max(50, args.k // 20), seed=0)
    mask = np.ones(args.vectors, bool)
    rows = []
    if not args.skip_flat:
        t0 = time.perf_counter()
        flat = FaissKMeans(k=args.k, niter=args.niter, seed=0).fit(x, mask)
        rows.append(("flat", time.perf_counter() - t0, flat))
        print(f"flat: {rows[-1][1]:.1f} s", flush=True)
    for nprobe in [int(v) for v in args.nprobe.split(",")]:
        t0 = time.perf_counter()
        two = TwoLevelKMeans(k=args.k, niter=args.niter, seed=0, nprobe=nprobe).fit(x, mask)
        rows.append((f"two_level nprobe={nprobe}", time.perf_counter() - t0, two))
        print(f"two_level nprobe={nprobe}: {rows[-1][1]:.1f} s", flush=True)
    base_s, base_inertia = rows[0][1], inertia(x, rows[0][2].centroids, rows[0][2].labels)
    print(f"\n{'clusterer':24s} {'seconds':>8s} {'inertia':>8s} {'cosine':>7s} {'speed-up':>9s} {'inertia ratio':>14s}")
    for name, secs, c in rows:
        ine = inertia(x, c.centroids, c.labels)
        print(f"{name:24s} {secs:8.1f} {ine:8.4f} {float(c.similarity.mean()):7.4f} {base_s / secs:8.1f}x "
              f"{ine / base_inertia:14.4f}", flush=True)


if __name__ == "__main__":
    main()
