"""Preprocessing at scale: embedding, flat vs hierarchical k-means, and assignment throughput.

Prints, in one process:
1. ccexp's sharded, resumable embedding vs a raw ``SentenceTransformer.encode`` on the same real
   documents of the embedded default corpus (docs/s and the ratio; goal >= 0.95x);
2. flat FAISS k-means vs ccexp's hierarchical k-means (finest level = the same K) on N vectors:
   wall time and inertia (mean squared L2 distance to the assigned centroid, lower is better) —
   vectors are a synthetic mixture of unit-norm Gaussians (MiniLM at ~90 docs/s cannot embed 1M
   documents on a laptop CPU);
3. assignment throughput (vectors/s) of the streamed nearest-centroid search.

Usage:
    python benches/bench_embed_cluster.py                              # quick: 4k docs, 200k x 384, K=2,000
    python benches/bench_embed_cluster.py --vectors 1000000 --k 10000 --levels 10000,1000,100   # the full size
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def bench_embedding(n_docs: int, shard_size: int) -> None:
    from sentence_transformers import SentenceTransformer

    from ccexp.data.corpus import BUILTIN_PATH
    from ccexp.embedding.sentence import SentenceEmbedder, resolve_model_path

    with gzip.open(BUILTIN_PATH, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][:n_docs]
    raw = SentenceTransformer(resolve_model_path("minilm"), device="cpu", local_files_only=True)
    raw.encode(texts[:64], batch_size=64)  # warm-up
    t0 = time.perf_counter()
    raw.encode(texts, batch_size=64, normalize_embeddings=True, show_progress_bar=False)
    raw_s = time.perf_counter() - t0
    ours = SentenceEmbedder(batch_size=64, device="cpu", shard_size=shard_size)
    ours.encode(texts[:64])  # warm-up (model load)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        ours.embed(texts, Path(d) / "e.npy", Path(d) / "work")
        ours_s = time.perf_counter() - t0
    print(f"embedding {n_docs:,} real docs: raw encode {n_docs / raw_s:.1f} docs/s, ccexp sharded {n_docs / ours_s:.1f} "
          f"docs/s, ratio {raw_s / ours_s:.3f}x")


def mixture(n: int, d: int, centers: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal((centers, d)).astype(np.float32)
    weights = 1.0 / np.arange(1, centers + 1)  # Zipf-like: dense and sparse regions
    which = rng.choice(centers, n, p=weights / weights.sum())
    x = mu[which] + 0.6 * rng.standard_normal((n, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def inertia(x: np.ndarray, centroids: np.ndarray, labels: np.ndarray) -> float:
    total = 0.0
    for s in range(0, x.shape[0], 65536):
        diff = x[s:s + 65536] - centroids[labels[s:s + 65536]]
        total += float((diff * diff).sum())
    return total / x.shape[0]


def bench_kmeans(n: int, k: int, levels: list[int], niter: int) -> None:
    from ccexp.clustering.hierarchical import HierarchicalKMeans
    from ccexp.clustering.kmeans import FaissKMeans, assign

    x = mixture(n, 384, max(50, k // 20), seed=0)
    mask = np.ones(n, bool)
    t0 = time.perf_counter()
    flat = FaissKMeans(k=k, niter=niter, seed=0).fit(x, mask)
    flat_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    hier = HierarchicalKMeans(levels=levels, niter=niter, seed=0, resampling_steps=[1] + [3] * (len(levels) - 1),
                              sample_size=[max(2, n // levels[0] // 2)] + [3] * (len(levels) - 1)).fit(x, mask)
    hier_s = time.perf_counter() - t0
    print(f"k-means on {n:,} x 384, K={k}, {niter} iterations: flat {flat_s:.1f} s (inertia "
          f"{inertia(x, flat.centroids, flat.labels):.4f}); hierarchical {levels} {hier_s:.1f} s (finest-level inertia "
          f"{inertia(x, hier.centroids, hier.labels):.4f}); time ratio hierarchical/flat {hier_s / flat_s:.2f}")
    t0 = time.perf_counter()
    assign(x, flat.centroids)
    secs = time.perf_counter() - t0
    print(f"assignment: {n / secs:,.0f} vectors/s against {k:,} centroids (FAISS flat inner product, batches of 65,536)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4096)
    ap.add_argument("--shard-size", type=int, default=2048)
    ap.add_argument("--vectors", type=int, default=200_000)
    ap.add_argument("--k", type=int, default=2000)
    ap.add_argument("--levels", default="2000,200,20")
    ap.add_argument("--niter", type=int, default=10)
    args = ap.parse_args()
    bench_embedding(args.docs, args.shard_size)
    bench_kmeans(args.vectors, args.k, [int(v) for v in args.levels.split(",")], args.niter)


if __name__ == "__main__":
    main()
