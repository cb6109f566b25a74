"""Sampler throughput at corpus scale: indices/second per policy against the naive way.

Builds a label array of N documents (default 100M) over K clusters (default 10,000) with
Zipf-distributed cluster sizes (exponent 1.1), then, for each policy, times construction and the
drawing of ``--steps`` blocks of ``--batch`` documents on one core. ``cluster_dp`` runs on CluSTER's
setting, K = the data-parallel world size (``--dp-clusters``, default 64, from the same documents
grouped by ``label mod 64``), drawing one block of ``batch / K`` documents per lane (cluster) each
step. The baseline, run in the same process, is the naive way to sample from per-document weights:
``torch.multinomial`` over N weights (torch caps the number of categories at 2**24, so the baseline
runs on the largest N it accepts and its rate is reported per index drawn). Peak memory is traced
per policy (tracemalloc sees NumPy's allocations; the compiled kernels allocate only O(K) and a
64K-entry scratch themselves) on top of the shared label array. ``dynamic`` gets feedback every
step; its per-cluster token counts are the exposure the step added (what ``bincount(labels[docs])``
gives, without timing that gather).

"M idx/s" is indices per second of wall-clock time (as the baseline's); "M idx/CPU-s" per second of
the process's CPU time, the same rate with the time the scheduler gave to other processes left out
(on a shared machine).

The samplers' hot loops are numba kernels (:mod:`ccexp.sampling.kernels`). Their one-time JIT
compile is not part of "build s": it is measured per policy in a fresh process with an empty numba
cache (``JIT s``: what the first run on a machine pays), and every kernel is compiled or loaded from
the cache before the timings (the first line says how long that took here).

Usage:
    python benches/bench_samplers.py                       # 100M documents, 10k clusters
    python benches/bench_samplers.py --documents 10000000  # quicker
"""
from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ccexp.sampling import (ClusterClipSampler, ClusterDPSampler, DynamicSampler, RandomSampler,  # noqa: E402
                            TemperatureSampler, UniformSampler, UniMaxSampler)
from ccexp.sampling import kernels  # noqa: E402


def zipf_labels(n: int, k: int, exponent: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    w = 1.0 / np.arange(1, k + 1) ** exponent
    sizes = np.maximum(1, np.floor(w / w.sum() * n)).astype(np.int64)
    sizes[0] += n - sizes.sum()
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(k, dtype=np.int32), sizes)
    rng.shuffle(labels)
    return labels, sizes


def time_policy(name, make, steps, feedback):
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    sampler = make()
    build = time.perf_counter() - t0
    def draw() -> np.ndarray:
        if sampler.num_lanes == 1:
            return sampler.next_block()
        return np.concatenate([sampler.next_block(lane) for lane in range(sampler.num_lanes)])

    draw()  # warm-up step (caches, first round)
    n = 0
    secs = cpu = 0.0
    for t in range(1, steps + 1):
        before = sampler.exposure()
        t0, c0 = time.perf_counter(), time.process_time()
        docs = draw()
        if feedback:  # the step's documents per cluster, as bincount(labels[docs]) counts them
            tokens = sampler.exposure() - before
            sampler.observe(t, tokens * 2.0, tokens)
        secs += time.perf_counter() - t0
        cpu += time.process_time() - c0
        n += docs.size
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del sampler
    return {"policy": name, "build_s": build, "indices_per_s": n / secs, "indices_per_cpu_s": n / cpu,
            "peak_mb": peak / 2**20}


def naive_multinomial(n_docs: int, batch: int, steps: int) -> float:
    torch.set_num_threads(1)
    n = min(n_docs, 2**24)
    weights = torch.rand(n, dtype=torch.float64)
    torch.multinomial(weights, batch, replacement=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        torch.multinomial(weights, batch, replacement=True)
    return steps * batch / (time.perf_counter() - t0), n


def policies(labels: np.ndarray, sizes: np.ndarray, batch: int, dp_clusters: int) -> list:
    """(name, factory, feedback) of every policy at the benchmark's settings."""
    b = batch
    dp_labels = (labels % dp_clusters).astype(np.int32)
    dp_sizes = np.bincount(dp_labels, minlength=dp_clusters).astype(np.int64)
    return [
        ("random", lambda: RandomSampler(labels, sizes, block_size=b), False),
        ("uniform", lambda: UniformSampler(labels, sizes, block_size=b), False),
        ("clusterclip", lambda: ClusterClipSampler(labels, sizes, block_size=b, clip_threshold=5), False),
        ("dynamic", lambda: DynamicSampler(labels, sizes, block_size=b, warmup_steps=0, update_every=1), True),
        ("cluster_dp", lambda: ClusterDPSampler(dp_labels, dp_sizes, block_size=max(1, b // dp_clusters),
                                                keep="random"), False),
        ("temperature", lambda: TemperatureSampler(labels, sizes, block_size=b, alpha=0.5), False),
        ("unimax", lambda: UniMaxSampler(labels, sizes, block_size=b, max_epochs=4), False),
    ]


def jit_probe(name: str) -> None:
    """Print the seconds a fresh process takes to build a small ``name`` sampler and draw from it: with an
    empty NUMBA_CACHE_DIR, that is the JIT compile of the kernels the policy uses."""
    labels, sizes = zipf_labels(20_000, 100, 1.1, 0)
    _, make, _ = next(p for p in policies(labels, sizes, 1_000, 4) if p[0] == name)
    t0 = time.perf_counter()
    sampler = make()
    for lane in range(sampler.num_lanes):
        sampler.next_block(lane)
    print(time.perf_counter() - t0)


def cold_jit_seconds(name: str) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, __file__, "--jit-probe", name], env=env, check=True,
                             capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=100_000_000)
    ap.add_argument("--clusters", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp-clusters", type=int, default=64, help="K for cluster_dp (CluSTER: K = world size)")
    ap.add_argument("--jit-probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.jit_probe:
        return jit_probe(args.jit_probe)
    import numba

    print(f"kernels: numba {numba.__version__}, compiled or loaded from its cache in {kernels.warm_up():.1f} s "
          "(before any timing)")

    t0 = time.perf_counter()
    labels, sizes = zipf_labels(args.documents, args.clusters, args.zipf, args.seed)
    print(f"corpus: {args.documents:,} documents, {args.clusters:,} clusters (Zipf {args.zipf}: largest "
          f"{sizes.max():,}, smallest {sizes.min():,}), labels {labels.nbytes / 2**20:.0f} MiB, "
          f"built in {time.perf_counter() - t0:.1f} s")
    base_rate, base_n = naive_multinomial(args.documents, args.batch, max(3, args.steps // 3))
    print(f"baseline: torch.multinomial over {base_n:,} per-document weights: {base_rate / 1e6:.2f} M indices/s "
          f"(1 thread)")
    print(f"{'policy':12s} {'build s':>8s} {'M idx/s':>8s} {'vs naive':>9s} {'peak MiB':>9s} {'JIT s':>6s} "
          f"{'M idx/CPU-s':>11s}")
    for name, make, feedback in policies(labels, sizes, args.batch, args.dp_clusters):
        r = time_policy(name, make, args.steps, feedback)
        print(f"{r['policy']:12s} {r['build_s']:8.1f} {r['indices_per_s'] / 1e6:8.2f} "
              f"{r['indices_per_s'] / base_rate:8.2f}x {r['peak_mb']:9.0f} {cold_jit_seconds(name):6.1f} "
              f"{r['indices_per_cpu_s'] / 1e6:11.2f}", flush=True)


if __name__ == "__main__":
    main()
