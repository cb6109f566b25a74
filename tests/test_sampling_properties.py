"""Property tests (hypothesis) of every invariant in SAMPLING.md for random, uniform and clusterclip."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.errors import CcexpError
from ccexp.sampling import (ClusterClipSampler, ClusterDPSampler, DynamicSampler, MixtureSampler, RandomSampler,
                            TemperatureSampler, UniformSampler, UniMaxSampler)
from ccexp.sampling.permutation import affine_permute, derive_keys, pass_hash, shuffled_groups
from helpers import source_mixture_factory

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def clustered(draw, max_k=8, max_n=12):
    """Cluster sizes (some possibly empty), labels in shuffled order, block size and seed."""
    sizes = np.array(draw(st.lists(st.integers(0, max_n), min_size=1, max_size=max_k)), dtype=np.int64)
    if sizes.sum() == 0:
        sizes[0] = 1
    labels = np.repeat(np.arange(sizes.size), sizes).astype(np.int32)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    labels = labels[rng.permutation(labels.size)]
    batch = draw(st.integers(1, 3 * sizes.size))
    return labels, sizes, batch, draw(st.integers(0, 2**31))


@SETTINGS
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**40), group=st.integers(0, 2**32 - 1))
def test_pass_permutation_is_a_bijection(n, seed, group):
    h = pass_hash(derive_keys(seed), np.full(n, group), np.zeros(n, np.int64))
    p = affine_permute(np.arange(n), n, h)
    assert np.array_equal(np.sort(p), np.arange(n))


def test_pass_permutations_differ_between_passes_and_are_bijective_near_the_size_limit():
    n = 2**31 - 1
    i = np.array([0, 1, n - 1])
    a = affine_permute(i, n, pass_hash(derive_keys(0), np.zeros(3, np.int64), np.zeros(3, np.int64)))
    b = affine_permute(i, n, pass_hash(derive_keys(0), np.zeros(3, np.int64), np.ones(3, np.int64)))
    assert ((a >= 0) & (a < n)).all() and len(set(a)) == 3 and not np.array_equal(a, b)
    orders = [affine_permute(np.arange(50), 50, pass_hash(derive_keys(1), np.zeros(50, np.int64), np.full(50, p)))
              for p in range(20)]
    assert len({tuple(o) for o in orders}) == 20


def test_shuffled_groups_groups_by_label_and_shuffles_within():
    labels = np.repeat(np.arange(3), [50, 1, 30]).astype(np.int32)
    order = shuffled_groups(labels, np.random.default_rng(0))
    assert np.array_equal(labels[order], np.sort(labels)) and np.array_equal(np.sort(order), np.arange(81))
    assert not np.array_equal(order[:50], np.arange(50))


# -- random -----------------------------------------------------------------------------------------
@SETTINGS
@given(clustered())
def test_random_every_document_once_per_epoch(data):
    labels, sizes, batch, seed = data
    n = labels.size
    s = RandomSampler(labels, sizes, block_size=batch, seed=seed)
    flat = stream(s, -(-3 * n // batch)).ravel()[: 3 * n]
    for epoch in range(3):
        assert np.array_equal(np.sort(flat[epoch * n:(epoch + 1) * n]), np.arange(n))
    assert s.max_repetition() == -(-s.exposure().sum() // n)


def test_random_cluster_frequencies_follow_sizes():
    sizes = np.array([500, 50, 5], dtype=np.int64)
    labels = np.repeat(np.arange(3), sizes).astype(np.int32)
    s = RandomSampler(labels, sizes, block_size=111, seed=3)
    stream(s, 555 // 111 * 10)  # exactly 10 epochs
    assert np.array_equal(s.exposure(), sizes * 10)


# -- uniform ----------------------------------------------------------------------------------------
@SETTINGS
@given(clustered(), st.integers(1, 40))
def test_uniform_cluster_counts_balanced_regardless_of_size(data, steps):
    labels, sizes, batch, seed = data
    s = UniformSampler(labels, sizes, block_size=batch, seed=seed)
    docs = stream(s, steps).ravel()
    counts = np.bincount(labels[docs], minlength=sizes.size)
    assert counts[sizes == 0].sum() == 0
    nz = counts[sizes > 0]
    assert nz.max() - nz.min() <= 1  # each round visits every cluster once
    assert np.array_equal(counts, s.exposure())


@SETTINGS
@given(clustered(), st.integers(1, 40))
def test_uniform_repetitions_within_a_cluster_differ_by_at_most_one(data, steps):
    labels, sizes, batch, seed = data
    s = UniformSampler(labels, sizes, block_size=batch, seed=seed)
    reps = np.bincount(stream(s, steps).ravel(), minlength=labels.size)
    for c in np.flatnonzero(sizes):
        r = reps[labels == c]
        assert r.max() - r.min() <= 1
    assert s.max_repetition() == reps.max()


def test_uniform_expected_repetitions_are_D_over_K_nc():
    sizes = np.array([400, 40, 4], dtype=np.int64)
    labels = np.repeat(np.arange(3), sizes).astype(np.int32)
    s = UniformSampler(labels, sizes, block_size=30, seed=0)
    reps = np.bincount(stream(s, 400).ravel(), minlength=labels.size)  # D = 12,000
    for c, n in enumerate(sizes):
        assert reps[labels == c].mean() == pytest.approx(12000 / (3 * n))


# -- clusterclip -------------------------------------------------------------------------------------
def test_clusterclip_figure1_toy():
    """Paper Fig. 1: A=5, B=1, C=3 documents, blocks of 3, M=2 -> B's document appears exactly twice,
    in the first two blocks, and never after."""
    sizes = np.array([5, 1, 3], dtype=np.int64)
    labels = np.repeat(np.arange(3), sizes).astype(np.int32)
    for seed in range(20):
        s = ClusterClipSampler(labels, sizes, block_size=3, seed=seed, clip_threshold=2)
        batches = stream(s, 6)
        b_doc = 5
        assert [(b == b_doc).sum() for b in batches] == [1, 1, 0, 0, 0, 0]
        assert all(sorted(labels[b].tolist()) == [0, 1, 2] for b in batches[:2])


@SETTINGS
@given(clustered(), st.integers(1, 4), st.sampled_from(["uniform", "proportional"]))
def test_clusterclip_never_exceeds_threshold_and_clipped_clusters_stay_out(data, m, after_clip):
    labels, sizes, batch, seed = data
    steps = m * labels.size // batch  # the whole budget the clip allows (rounded down)
    s = ClusterClipSampler(labels, sizes, block_size=batch, seed=seed, clip_threshold=m, after_clip=after_clip,
                           document_tokens=np.ones(labels.size, np.int64), token_budget=steps * batch)
    reps = np.zeros(labels.size, np.int64)
    gone: set[int] = set()
    for t in range(steps):
        docs = s.next_block()
        assert not gone & set(labels[docs].tolist()), "a clipped cluster reappeared"
        np.add.at(reps, docs, 1)
        assert reps.max() <= m
        gone |= {c for c in np.flatnonzero(sizes) if reps[labels == c].min() == m}
        assert s.active_clusters() == np.count_nonzero(sizes) - len(gone)


@SETTINGS
@given(clustered(), st.integers(1, 30))
def test_clusterclip_equals_uniform_when_threshold_exceeds_budget(data, steps):
    labels, sizes, batch, seed = data
    clip = ClusterClipSampler(labels, sizes, block_size=batch, seed=seed, clip_threshold=steps * batch)
    uni = UniformSampler(labels, sizes, block_size=batch, seed=seed)
    assert np.array_equal(stream(clip, steps), stream(uni, steps))


@SETTINGS
@given(clustered(), st.integers(1, 3))
def test_clusterclip_frequencies_uniform_while_all_clusters_active(data, m):
    labels, sizes, batch, seed = data
    s = ClusterClipSampler(labels, sizes, block_size=batch, seed=seed, clip_threshold=m)
    drawn = []
    t = 0
    k_active = np.count_nonzero(sizes)
    while (t + 1) * batch <= m * labels.size:
        docs = s.next_block()
        if s.active_clusters() < k_active:
            break
        drawn.append(docs)
        t += 1
    if drawn:
        counts = np.bincount(labels[np.concatenate(drawn)], minlength=sizes.size)[sizes > 0]
        assert counts.max() - counts.min() <= 1


def test_clusterclip_budget_error_names_the_largest_budget_in_tokens():
    sizes = np.array([5, 1, 3], dtype=np.int64)
    labels = np.repeat(np.arange(3), sizes).astype(np.int32)
    doc_tokens = np.arange(1, 10, dtype=np.int64)  # 45 tokens in all
    with pytest.raises(CcexpError, match=r"at most 18 document draws = 90 tokens from 9 training documents; the run needs 91"):
        ClusterClipSampler(labels, sizes, block_size=3, clip_threshold=2, document_tokens=doc_tokens, token_budget=91)
    ClusterClipSampler(labels, sizes, block_size=3, clip_threshold=2, document_tokens=doc_tokens, token_budget=90)
    s = ClusterClipSampler(labels, sizes, block_size=4, clip_threshold=2)  # budget unknown up front
    blocks = [s.next_block() for _ in range(5)]  # 18 draws: four blocks of 4, then the 2 that are left
    assert [b.size for b in blocks] == [4, 4, 4, 4, 2]
    assert np.array_equal(np.bincount(np.concatenate(blocks), minlength=9), np.full(9, 2))
    with pytest.raises(CcexpError, match="every cluster is exhausted"):
        s.next_block()


def test_clusterclip_reset_starts_new_clip_periods():
    sizes = np.array([5, 1, 3], dtype=np.int64)
    labels = np.repeat(np.arange(3), sizes).astype(np.int32)
    s = ClusterClipSampler(labels, sizes, block_size=3, clip_threshold=2, on_exhausted="reset")
    docs = stream(s, 60).ravel()  # 10 full clip periods of 18 draws
    for period in docs.reshape(10, 18):
        assert np.array_equal(np.bincount(period, minlength=9), np.full(9, 2))


@pytest.mark.parametrize("bad", [dict(clip_threshold=0), dict(after_clip="nope"), dict(on_exhausted="nope")])
def test_clusterclip_rejects_bad_options(bad):
    with pytest.raises(CcexpError):
        ClusterClipSampler(np.zeros(3, np.int32), np.array([3]), block_size=1, **bad)


# -- every policy: determinism, resume, data parallelism -----------------------------------------
POLICIES = [
    (RandomSampler, {}),
    (UniformSampler, {}),
    (ClusterClipSampler, dict(clip_threshold=5)),
    (ClusterClipSampler, dict(clip_threshold=2, after_clip="proportional", on_exhausted="reset")),
    (DynamicSampler, dict(warmup_steps=3, update_every=2)),
    (DynamicSampler, dict(warmup_steps=0, update_every=1, rule="doremi", reference_losses=[1.0] * 5,
                          clip_threshold=4, on_exhausted="reset")),
    (ClusterDPSampler, dict(keep="random")),
    (TemperatureSampler, dict(alpha=0.5)),
    (UniMaxSampler, dict(max_epochs=2, on_exhausted="reset")),
    (MixtureSampler, dict(weights=[0.4, 0.1, 0.2, 0.0, 0.3])),
    (MixtureSampler, dict(weights=[4, 1, 2, 0, 3], max_repetitions=2, on_exhausted="reset")),
    (MixtureSampler, dict(weights=[4, 1, 2, 0, 3], weight_unit="documents", max_repetitions=2, on_exhausted="reset")),
]
# target token shares per source with a cluster policy inside each (not in the histogram test: its
# histogram also counts the documents an inner policy has drawn into its buffer, see ccexp.sampling.sources)
SOURCE_POLICIES = [
    (source_mixture_factory(UniformSampler), {}),
    (source_mixture_factory(ClusterClipSampler, clip_threshold=2, on_exhausted="reset"), {}),
    (source_mixture_factory(DynamicSampler, weights=(1, 2), warmup_steps=3, update_every=2), {}),
]


def stream(sampler, steps, start=0):
    """Draw ``steps`` rounds of one block per lane, feeding back a loss that depends on what was drawn
    (as training would after each step)."""
    out = []
    for t in range(start, start + steps):
        docs = np.concatenate([sampler.next_block(lane) for lane in range(sampler.num_lanes)])
        tokens = np.bincount(sampler.labels[docs], minlength=sampler.num_clusters) * 3
        sampler.observe(t, tokens * (1.0 + (np.arange(sampler.num_clusters) + t) % 3), tokens)
        out.append(docs)
    return np.stack(out) if out else np.zeros((0, sampler.block_size * sampler.num_lanes), np.int64)


@pytest.mark.parametrize("cls,kw", POLICIES + SOURCE_POLICIES)
def test_stream_is_deterministic_from_seed(cls, kw):
    sizes = np.array([40, 8, 4, 0, 12], dtype=np.int64)
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(5), sizes)).astype(np.int32)
    a = stream(cls(labels, sizes, block_size=8, seed=5, **kw), 20)
    b = stream(cls(labels, sizes, block_size=8, seed=5, **kw), 20)
    c = stream(cls(labels, sizes, block_size=8, seed=6, **kw), 20)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("cls,kw", POLICIES + SOURCE_POLICIES)
@SETTINGS
@given(stop=st.integers(0, 25))
def test_resume_from_state_dict_continues_the_same_stream(cls, kw, stop):
    sizes = np.array([40, 7, 3, 0, 12], dtype=np.int64)
    labels = np.random.default_rng(1).permutation(np.repeat(np.arange(5), sizes)).astype(np.int32)
    full = stream(cls(labels, sizes, block_size=8, seed=2, **kw), 30)
    first = cls(labels, sizes, block_size=8, seed=2, **kw)
    stream(first, stop)
    state = first.state_dict()
    resumed = cls(labels, sizes, block_size=8, seed=2, **kw)
    resumed.load_state_dict(state)
    rest = stream(resumed, 30 - stop, start=stop)
    assert np.array_equal(rest, full[stop:])


def test_a_lane_outside_the_policy_is_rejected():
    s = UniformSampler(np.zeros(4, np.int32), np.array([4]), block_size=2)
    with pytest.raises(ValueError, match="1 lane"):
        s.next_block(1)


@SETTINGS
@given(clustered(), st.integers(1, 7))
def test_deterministic_streams_do_not_depend_on_the_block_size(data, other):
    labels, sizes, batch, seed = data
    for cls, kw in [(RandomSampler, {}), (UniformSampler, {}), (ClusterClipSampler, dict(clip_threshold=3,
                                                                                         on_exhausted="reset"))]:
        s1, s2 = cls(labels, sizes, block_size=batch, seed=seed, **kw), cls(labels, sizes, block_size=other,
                                                                          seed=seed, **kw)
        n = 6 * batch * other
        a = np.concatenate([s1.next_block() for _ in range(n // batch)])
        b = np.concatenate([s2.next_block() for _ in range(n // other)])
        assert np.array_equal(a, b), cls.name


@pytest.mark.parametrize("labels,sizes", [(np.zeros(0, np.int32), np.array([1])),
                                          (np.array([0, 2], np.int32), np.array([1, 1])),
                                          (np.array([0, 1], np.int32), np.array([2, 0]))])
def test_bad_labels_or_sizes_are_rejected(labels, sizes):
    with pytest.raises(CcexpError):
        UniformSampler(labels, sizes, block_size=1)


def test_telemetry_mix_statistics_over_the_run_and_the_window():
    sizes = np.array([300, 60, 30, 0, 10], dtype=np.int64)
    labels = np.random.default_rng(3).permutation(np.repeat(np.arange(5), sizes)).astype(np.int32)
    rnd = RandomSampler(labels, sizes, block_size=40, seed=0)
    stream(rnd, 40)  # exactly 4 epochs
    tel = rnd.telemetry()
    assert tel["kl_to_corpus"] == pytest.approx(0.0, abs=1e-12) and tel["mean_repetition"] == 4.0
    uni = UniformSampler(labels, sizes, block_size=40, seed=0)
    stream(uni, 10)
    before = uni.exposure()
    stream(uni, 5, start=10)
    tel = uni.telemetry(since=before)
    assert tel["kl_to_uniform"] == pytest.approx(0.0, abs=1e-12) and tel["window_kl_to_uniform"] == pytest.approx(0.0, abs=1e-12)
    assert tel["mix_entropy"] == pytest.approx(np.log(4)) and tel["active_clusters"] == 4
    assert tel["max_repetition"] == 15  # 600 draws / 4 clusters = 150 draws of the 10-document cluster


@pytest.mark.parametrize("cls,kw", POLICIES)
def test_repetition_histogram_matches_counted_repetitions(cls, kw):
    sizes = np.array([40, 8, 4, 0, 12], dtype=np.int64)
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(5), sizes)).astype(np.int32)
    s = cls(labels, sizes, block_size=8, seed=1, **kw)
    counts = np.bincount(stream(s, 13).ravel(), minlength=labels.size)
    expect = {int(r): int(c) for r, c in zip(*np.unique(counts, return_counts=True))}
    assert s.repetition_histogram() == expect
