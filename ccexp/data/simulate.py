"""A policy's exact token stream without a model: what ``train.steps`` optimizer steps of
``train.tokens_per_step`` tokens would draw, per cluster, in seconds — to choose M (the clip
threshold), K and the budget before paying for training runs.

[`simulate`][ccexp.data.simulate.simulate] drives the same [`TokenStream`][ccexp.data.packing.TokenStream] over the same sampler as
training (the policy's ``observe()`` gets no loss: a loss-driven policy stays at its prior), and
counts, per cluster, the documents drawn and the tokens trained (each step's inputs, as the
training module counts them into ``tables/clusters.csv``'s ``train_tokens``), the step at which a
clip took each cluster out, and the mix's entropy and KL divergences over time.
[`synthetic_corpus`][ccexp.data.simulate.synthetic_corpus] gives Zipf-sized clusters with log-normal document lengths for corpora
that do not exist yet (100M documents, 10,000 clusters).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ccexp.data.packing import TokenStream
from ccexp.sampling.base import Sampler, mix_statistics

log = logging.getLogger("ccexp")


@dataclass
class StreamPlan:
    """What a policy draws (see the module docstring).

    Attributes:
        documents: int64[K] documents drawn per cluster (the sampler's exposure).
        tokens: int64[K] tokens trained per cluster (inputs of every step, all ranks).
        clipped_at: int64[K] the step after which a clip took the cluster out (-1: never).
        sizes: int64[K] training documents per cluster.
        history: ``{"step", "tokens", "mix_entropy", "kl_to_corpus", "kl_to_uniform", "active_clusters"}``
            lists, recorded every ``record_every`` steps: the mix of the tokens trained so far, against
            the corpus's *token* mix (``corpus_tokens``) and uniform.
        repetition_histogram: draws -> documents ([`Sampler.repetition_histogram`][ccexp.sampling.base.Sampler.repetition_histogram]).
        seconds: wall time of the simulation.
    """

    steps: int
    tokens_per_step: int
    documents: np.ndarray
    tokens: np.ndarray
    clipped_at: np.ndarray
    sizes: np.ndarray
    history: dict[str, list[float]] = field(default_factory=dict)
    repetition_histogram: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    corpus_tokens: np.ndarray | None = None  # int64[K] the training split's tokens per cluster (stream lengths)
    digest: str = ""  # the stream's digest (TokenStream.digest): equal digests = the identical token stream
    group_tokens: np.ndarray | None = None  # int64[G] tokens trained per group (e.g. per source), when groups given
    group_names: list[str] | None = None  # the G groups' names (set by the caller)
    group_targets: np.ndarray | None = None  # float64[G] their target token shares (data.sources' weights)


def step_cluster_tokens(stream: TokenStream, plan, labels: np.ndarray, num_clusters: int) -> np.ndarray:
    """int64[K] input tokens of each cluster in step ``plan`` (segment lengths, less each lane's
    one-token look-ahead, which is the next step's first input)."""
    length = np.diff(plan.pos)
    look_ahead = plan.lane_base + stream.rows_in_lane * stream.seq_len  # the position past each lane's inputs
    seg = np.searchsorted(plan.pos, look_ahead, side="right") - 1
    np.subtract.at(length, seg, 1)
    return np.bincount(labels[plan.doc], weights=length, minlength=num_clusters).astype(np.int64)


def simulate(sampler: Sampler, lengths: np.ndarray, *, steps: int, tokens_per_step: int, seq_len: int,
             max_doc_tokens: int | None = None, record_every: int = 100, progress_every_s: float = 10.0,
             groups: np.ndarray | None = None) -> StreamPlan:
    """Run ``steps`` steps of ``sampler``'s token stream over documents of ``lengths`` tokens (int64[N],
    the sampler's documents; the stream adds each one's separator and applies ``max_doc_tokens``, as
    in training) and count what was drawn; ``groups`` (int[N] a group id per document, e.g. its source):
    the tokens trained per group too.

    Raises:
        CcexpError: from the sampler (e.g. a clip that runs out) or the stream's layout.
    """
    t0 = last = time.perf_counter()
    k = sampler.num_clusters
    stream = TokenStream(sampler, lengths, seq_len=seq_len, rows_per_step=tokens_per_step // seq_len,
                         max_doc_tokens=max_doc_tokens)
    tokens = np.zeros(k, dtype=np.int64)
    corpus_tokens = np.bincount(sampler.labels, weights=stream.stream_len, minlength=k).astype(np.int64)
    clipped_at = np.full(k, -1, dtype=np.int64)
    history: dict[str, list[float]] = {key: [] for key in ("step", "tokens", "mix_entropy", "kl_to_corpus",
                                                           "kl_to_uniform", "active_clusters")}
    group_tokens = None if groups is None else np.zeros(int(np.max(groups)) + 1, dtype=np.int64)
    for step in range(steps):
        plan = stream.plan_step()
        tokens += step_cluster_tokens(stream, plan, sampler.labels, k)
        if groups is not None:
            group_tokens += step_cluster_tokens(stream, plan, groups, group_tokens.size)
        sampler.observe(step, np.zeros(k), np.zeros(k, dtype=np.int64))
        newly = sampler.clipped() & (clipped_at < 0)
        clipped_at[newly] = step
        if (step + 1) % record_every == 0 or step + 1 == steps:
            stats = mix_statistics(tokens, corpus_tokens)  # tokens against tokens (random's mix: KL ≈ 0)
            history["step"].append(step + 1)
            history["tokens"].append(float(tokens.sum()))
            for key in ("mix_entropy", "kl_to_corpus", "kl_to_uniform"):
                history[key].append(stats.get(key, float("nan")))
            history["active_clusters"].append(float(sampler.active_clusters()))
        now = time.perf_counter()
        if now - last >= progress_every_s:
            last = now
            log.info("plan: step %d/%d, %s tokens, %.0f steps/s", step + 1, steps, f"{int(tokens.sum()):,}",
                     (step + 1) / (now - t0))
    return StreamPlan(steps, tokens_per_step, sampler.exposure(), tokens, clipped_at, sampler.sizes.copy(), history,
                      sampler.repetition_histogram(), time.perf_counter() - t0, corpus_tokens, stream.digest, group_tokens)


def synthetic_corpus(num_clusters: int, num_documents: int, *, zipf: float = 1.0, mean_tokens: float = 500.0,
                     sigma: float = 1.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zipf-sized clusters (``n_c ∝ c^-zipf``, every cluster at least one document, summing to N) with
    log-normal document lengths (mean ``mean_tokens``, log-space spread ``sigma``, at least 1 token).
    When K is close to N, so that giving every small cluster its one document would exceed N, each cluster
    gets one document and the other ``N - K`` are shared by the Zipf shares (largest remainders).

    Raises:
        ValueError: for ``K < 1``, ``N < K``, ``zipf < 0``, ``mean_tokens < 1`` or ``sigma < 0`` (pre-flight
            refuses these in one line first).

    Returns:
        labels int32[N] (grouped by cluster), sizes int64[K], lengths int64[N] (tokens per document).
    """
    if not (1 <= num_clusters <= num_documents and zipf >= 0 and mean_tokens >= 1 and sigma >= 0):
        raise ValueError(f"synthetic corpus: need 1 <= K <= N, zipf >= 0, mean_tokens >= 1, sigma >= 0; got K="
                         f"{num_clusters}, N={num_documents}, zipf={zipf}, mean_tokens={mean_tokens}, sigma={sigma}")
    share = 1.0 / np.arange(1, num_clusters + 1, dtype=np.float64) ** zipf
    share /= share.sum()
    sizes = np.maximum(1, np.floor(share * num_documents)).astype(np.int64)
    if sizes.sum() <= num_documents:
        sizes[0] += num_documents - int(sizes.sum())  # the largest cluster absorbs the rounding
    else:  # one document each, the rest by the shares, largest remainders first
        rest = share * (num_documents - num_clusters)
        sizes = 1 + np.floor(rest).astype(np.int64)
        short = num_documents - int(sizes.sum())
        sizes[np.argsort(-(rest - np.floor(rest)), kind="stable")[:short]] += 1
    labels = np.repeat(np.arange(num_clusters, dtype=np.int32), sizes)
    rng = np.random.default_rng(seed)
    mu = np.log(mean_tokens) - sigma**2 / 2  # so the mean is mean_tokens
    lengths = np.maximum(1, rng.lognormal(mu, sigma, num_documents)).astype(np.int64)
    return labels, sizes, lengths
