"""The in-between baselines (SAMPLING.md "temperature" and "unimax"): their invariants, as property
tests; determinism, resume and world-size are covered with every policy in test_sampling_properties.py
and test_token_stream.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.errors import CcexpError
from ccexp.sampling import RandomSampler, TemperatureSampler, UniformSampler, UniMaxSampler
from ccexp.sampling.temperature import temperature_weights
from ccexp.sampling.unimax import unimax_allocation
from helpers import clustered_documents

SETTINGS = settings(max_examples=60, deadline=None)



def frequencies(sampler, blocks):
    docs = np.concatenate([sampler.next_block() for _ in range(blocks)])
    return np.bincount(sampler.labels[docs], minlength=sampler.num_clusters) / docs.size


@SETTINGS
@given(sizes=st.lists(st.integers(0, 1000), min_size=1, max_size=12), alpha=st.floats(0, 1))
def test_temperature_weights_interpolate_between_the_corpus_mix_and_uniform(sizes, alpha):
    sizes = np.array(sizes)
    if sizes.sum() == 0:
        sizes[0] = 1
    w = temperature_weights(sizes, alpha)
    assert w.sum() == pytest.approx(1.0) and (w[sizes == 0] == 0).all()
    nz = sizes > 0
    np.testing.assert_allclose(temperature_weights(sizes, 1.0)[nz], sizes[nz] / sizes.sum())
    np.testing.assert_allclose(temperature_weights(sizes, 0.0)[nz], 1.0 / nz.sum())
    order = np.argsort(sizes[nz], kind="stable")  # a larger cluster never gets less
    assert (np.diff(w[nz][order]) >= -1e-12).all()


@pytest.mark.parametrize("alpha,baseline", [(1.0, RandomSampler), (0.0, UniformSampler)])
def test_temperature_ends_match_random_and_uniform_cluster_mixes(alpha, baseline):
    labels, sizes = clustered_documents([2000, 400, 60, 0, 10])
    got = frequencies(TemperatureSampler(labels, sizes, block_size=500, seed=1, alpha=alpha), 80)
    want = frequencies(baseline(labels, sizes, block_size=500, seed=1), 80)
    np.testing.assert_allclose(got, want, atol=0.01)


def test_temperature_half_flattens_the_mix_as_the_formula_says():
    labels, sizes = clustered_documents([4000, 400, 40])
    got = frequencies(TemperatureSampler(labels, sizes, block_size=1000, seed=2, alpha=0.5), 100)
    np.testing.assert_allclose(got, np.sqrt(sizes) / np.sqrt(sizes).sum(), atol=0.01)


def test_temperature_alpha_out_of_range_is_refused():
    labels, sizes = clustered_documents([3, 3])
    with pytest.raises(CcexpError, match=r"sampler.alpha=1.5 must be in \[0, 1\]"):
        TemperatureSampler(labels, sizes, alpha=1.5)


def sequential_unimax(t, budget, epochs):
    """Chung et al. 2023, Algorithm 1, written as the paper's loop."""
    alloc, left = np.zeros(len(t)), budget
    order = [c for c in np.argsort(t, kind="stable") if t[c] > 0]
    for i, c in enumerate(order):
        alloc[c] = min(epochs * t[c], left / (len(order) - i))
        left -= alloc[c]
    return alloc


@SETTINGS
@given(t=st.lists(st.integers(0, 10_000), min_size=1, max_size=20), epochs=st.integers(1, 5),
       frac=st.floats(0, 1))
def test_unimax_allocation_is_the_papers_algorithm_and_respects_the_cap(t, epochs, frac):
    t = np.array(t, dtype=np.float64)
    if t.sum() == 0:
        t[0] = 1
    budget = frac * epochs * t.sum()
    a = unimax_allocation(t, budget, epochs)
    np.testing.assert_allclose(a, sequential_unimax(t, budget, epochs), rtol=1e-9, atol=1e-6)
    assert a.sum() == pytest.approx(budget, rel=1e-9, abs=1e-6)  # Σ allocation = D when D <= E·T
    assert (a <= epochs * t + 1e-6).all()
    uncapped = a < epochs * t - 1e-6
    if uncapped.any():  # whatever is not capped shares equally
        np.testing.assert_allclose(a[uncapped], a[uncapped].max())


def test_unimax_equals_uniform_when_every_cluster_absorbs_the_uniform_share():
    labels, sizes = clustered_documents([300, 200, 100])
    s = UniMaxSampler(labels, sizes, block_size=30, seed=0, max_epochs=4, token_budget=300)  # 100 docs each
    np.testing.assert_allclose(s.allocation, [100, 100, 100])
    np.testing.assert_allclose(s.weights(), 1 / 3)


def test_unimax_never_draws_a_document_more_than_max_epochs_times():
    labels, sizes = clustered_documents([500, 40, 5])
    tokens = np.random.default_rng(0).integers(1, 50, labels.size)
    budget = int(0.9 * 2 * tokens.sum())  # 90 % of what a cap of 2 epochs can supply
    s = UniMaxSampler(labels, sizes, block_size=64, seed=3, document_tokens=tokens, token_budget=budget, max_epochs=2)
    drawn, taken = [], 0
    while taken < budget:
        block = s.next_block()
        drawn.append(block)
        taken += int(tokens[block].sum())
    counts = np.bincount(np.concatenate(drawn), minlength=labels.size)
    assert counts.max() <= 2
    small = labels == 2  # the 5-document cluster is capped at 2 epochs; the largest takes the rest
    assert counts[small].sum() <= 10 and s.max_repetition() <= 2


def test_unimax_refuses_a_budget_the_cap_cannot_hold():
    labels, sizes = clustered_documents([10, 10])
    with pytest.raises(CcexpError, match=r"sampler.max_epochs=2 allows at most 40 document draws = 200 tokens .* raise "
                                         r"sampler.max_epochs"):  # UniMax's own key, not ClusterClip's
        UniMaxSampler(labels, sizes, document_tokens=np.full(20, 5), token_budget=20 * 5 * 3, max_epochs=2)
