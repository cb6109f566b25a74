"""``SourceMixture`` (issue 23): target token shares per source hold to within one document at every
prefix of the stream, each source's documents come in its inner policy's order, exact resume, and
one-line errors for bad sources and weights."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.data.packing import TokenStream
from ccexp.errors import CcexpError
from ccexp.sampling import (ClusterClipSampler, ClusterDPSampler, DynamicSampler, RandomSampler, SourceMixture,
                            UniformSampler)
from ccexp.sampling.sources import inner_seed

INNERS = [UniformSampler, RandomSampler,
          functools.partial(ClusterClipSampler, clip_threshold=2, on_exhausted="reset"),
          functools.partial(ClusterClipSampler, clip_threshold=2, after_clip="proportional", on_exhausted="reset")]


@st.composite
def sourced_corpus(draw):
    """Labels, sizes, source ids, weights (some zero; every positive one with documents), tokens, block, seed."""
    k = draw(st.integers(1, 6))
    s = draw(st.integers(1, 5))
    n = draw(st.integers(s, 80))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    labels = rng.integers(0, k, n).astype(np.int32)
    sources = rng.permutation(np.concatenate([np.arange(s), rng.integers(0, s, n - s)]))
    weights = np.array(draw(st.lists(st.one_of(st.just(0.0), st.floats(0.01, 100.0)), min_size=s, max_size=s)))
    if not weights.sum() > 0:
        weights[0] = 1.0
    max_len = draw(st.sampled_from([1, 5, 60, 2000]))
    tokens = rng.integers(1, max_len + 1, n).astype(np.int64)
    if draw(st.booleans()):  # a few very long documents among short ones
        tokens[rng.random(n) < 0.1] = max_len * 20
    return (labels, np.bincount(labels, minlength=k).astype(np.int64), sources, weights, tokens,
            draw(st.integers(1, 12)), draw(st.integers(0, 2**31)))


@settings(max_examples=60, deadline=None)
@given(sourced_corpus(), st.integers(0, len(INNERS) - 1), st.integers(1, 30))
def test_token_shares_hold_within_one_document_at_every_prefix(data, which, blocks):
    labels, sizes, sources, weights, tokens, block, seed = data
    s = SourceMixture(labels, sizes, sources=sources, source_weights=weights, inner=INNERS[which],
                      block_size=block, seed=seed, document_tokens=tokens)
    docs = np.concatenate([s.next_block() for _ in range(blocks)])
    w = weights / weights.sum()
    assert not np.isin(sources[docs], np.flatnonzero(w == 0)).any()  # weight 0: never drawn
    big = int(tokens[np.isin(sources, np.flatnonzero(w > 0))].max())  # L, the largest document in play
    # x_s after every document: tokens taken from each source (one column per source), T the total
    x = np.zeros((docs.size + 1, w.size))
    x[np.arange(1, docs.size + 1), sources[docs]] = tokens[docs]
    x = np.cumsum(x, axis=0)
    dev = x - x.sum(axis=1, keepdims=True) * w  # x_s - w_s T at every prefix
    eps = 1e-9 * max(1.0, float(x[-1].sum()))
    assert (dev <= (1 - w) * big + eps).all()  # never ahead by more than (1 - w_s) L
    assert (dev >= -big - eps).all()  # never behind by more than L
    assert np.array_equal(s.source_tokens(), x[-1].astype(np.int64))
    assert np.array_equal(s.exposure(), np.bincount(labels[docs], minlength=sizes.size))


def test_shares_hold_to_the_token_in_a_packed_plan():
    """The acceptance: 70 % web / 30 % code, ClusterClip inside each, planned through the token stream."""
    rng = np.random.default_rng(0)
    n = 3000
    sources = (rng.random(n) < 0.2).astype(np.int64)  # 80 % of the documents are web, 20 % code
    labels = np.where(sources == 0, rng.integers(0, 6, n), rng.integers(4, 9, n)).astype(np.int32)  # 4, 5 shared
    doc_tokens = rng.integers(10, 400, n)
    stream_len = doc_tokens + 1
    budget = 200 * 32 * 64
    s = SourceMixture(labels, np.bincount(labels, minlength=9), sources=sources, source_weights=[0.7, 0.3],
                      inner=functools.partial(ClusterClipSampler, clip_threshold=4), block_size=40, seed=1,
                      document_tokens=stream_len, token_budget=budget, source_names=["web", "code"])
    stream = TokenStream(s, doc_tokens, seq_len=64, rows_per_step=32)
    taken = np.zeros(2)
    for _ in range(200):
        plan = stream.plan_step()
        # the step's 2048 stream tokens (its window's last position is re-read as the next step's first)
        np.add.at(taken, sources[plan.doc], np.diff(np.minimum(plan.pos, 32 * 64)))
        # at every step boundary, the planned tokens of each source are within one document of its share
        assert np.all(np.abs(taken - np.array([0.7, 0.3]) * taken.sum()) <= stream_len.max())
    assert taken.sum() == budget and abs(taken[0] - 0.7 * budget) <= stream_len.max()
    (level, line), = s.notes()
    assert "web 70.0 %" in line and "code 30.0 %" in line and "clusterclip" in line


def test_within_a_source_documents_follow_the_inner_policy():
    rng = np.random.default_rng(4)
    n = 400
    sources = rng.integers(0, 3, n)
    labels = rng.integers(0, 5, n).astype(np.int32)
    labels[sources == 2] = rng.choice([1, 3], int((sources == 2).sum()))  # source 2 holds only clusters 1 and 3
    tokens = rng.integers(1, 30, n)
    sizes = np.bincount(labels, minlength=5)
    s = SourceMixture(labels, sizes, sources=sources, source_weights=[5, 3, 2], inner=UniformSampler, block_size=16,
                      seed=9, document_tokens=tokens)
    docs = np.concatenate([s.next_block() for _ in range(60)])
    for src in range(3):
        mine = docs[sources[docs] == src]
        members = np.flatnonzero(sources == src)
        twin = UniformSampler(labels[members], np.bincount(labels[members], minlength=5), block_size=16,
                              seed=inner_seed(9, src), document_tokens=tokens[members])
        expect = members[np.concatenate([twin.next_block() for _ in range(-(-mine.size // 16))])][:mine.size]
        assert np.array_equal(mine, expect)  # exactly the inner policy's stream, mapped to global indices
        counts = np.bincount(labels[mine], minlength=5)
        held = np.bincount(labels[members], minlength=5) > 0
        assert counts[held].max() - counts[held].min() <= 1 and counts[~held].sum() == 0  # uniform within the source


def test_clusterclip_inside_a_source_clips_and_running_out_names_the_source():
    rng = np.random.default_rng(2)
    n = 60
    sources = np.arange(n) % 2
    labels = rng.integers(0, 3, n).astype(np.int32)
    tokens = np.full(n, 10)
    kw = dict(sources=sources, source_weights=[0.9, 0.1], inner=functools.partial(ClusterClipSampler, clip_threshold=2),
              block_size=5, seed=0, document_tokens=tokens, source_names=["web", "code"])
    sizes = np.bincount(labels, minlength=3)
    with pytest.raises(CcexpError, match="source web: sampler.clip_threshold=2 allows at most") as e:
        SourceMixture(labels, sizes, token_budget=700, **kw)  # web needs 630 + 10 tokens, 2 x 300 are there
    assert "\n" not in str(e.value)
    s = SourceMixture(labels, sizes, token_budget=600, **kw)
    docs = []
    with pytest.raises(CcexpError, match="source web ran out, so its share 0.9 cannot be held") as e:
        for _ in range(100):
            docs.append(s.next_block())
    assert "\n" not in str(e.value)
    docs = np.concatenate(docs)
    assert np.bincount(docs, minlength=n).max() <= 2  # no document beyond the clip
    assert s.source_tokens()[0] == 2 * 300  # every web document twice, then the stream stopped


def through_a_checkpoint(state):
    """``state`` saved and loaded as training checkpoints it (tensors, ``torch.load(weights_only=True)``)."""
    import io

    import torch

    def to_torch(o):
        return torch.from_numpy(o) if isinstance(o, np.ndarray) else ({k: to_torch(v) for k, v in o.items()}
                                                                       if isinstance(o, dict) else o)

    def to_numpy(o):
        return o.numpy() if isinstance(o, torch.Tensor) else ({k: to_numpy(v) for k, v in o.items()}
                                                              if isinstance(o, dict) else o)

    buf = io.BytesIO()
    torch.save(to_torch(state), buf)
    buf.seek(0)
    return to_numpy(torch.load(buf, weights_only=True))


def test_determinism_and_exact_resume_mid_stream():
    rng = np.random.default_rng(5)
    n = 200
    sources, labels, tokens = rng.integers(0, 3, n), rng.integers(0, 4, n).astype(np.int32), rng.integers(1, 90, n)
    make = functools.partial(SourceMixture, labels, np.bincount(labels, minlength=4), sources=sources,
                             source_weights=[0.5, 0.2, 0.3], inner=functools.partial(ClusterClipSampler, clip_threshold=3,
                                                                                      on_exhausted="reset"),
                             block_size=7, document_tokens=tokens)
    a, b, c = make(seed=3), make(seed=3), make(seed=4)
    full = np.stack([a.next_block() for _ in range(40)])
    assert np.array_equal(full, np.stack([b.next_block() for _ in range(40)]))
    assert not np.array_equal(full, np.stack([c.next_block() for _ in range(40)]))
    for stop in (0, 1, 13, 39):
        first = make(seed=3)
        for _ in range(stop):
            first.next_block()
        resumed = make(seed=3)
        resumed.load_state_dict(through_a_checkpoint(first.state_dict()))
        assert np.array_equal(np.stack([resumed.next_block() for _ in range(40 - stop)]), full[stop:])
        assert np.array_equal(resumed.source_tokens(), a.source_tokens())
    other = make(seed=3, source_weights=[0.4, 0.3, 0.3])
    with pytest.raises(CcexpError, match="other data.sources weights"):
        other.load_state_dict(a.state_dict())


def test_feedback_policies_get_the_runs_signal_and_lane_policies_are_refused():
    n = 40
    labels = (np.arange(n) % 4).astype(np.int32)
    sizes = np.bincount(labels, minlength=4)
    sources, tokens = np.arange(n) % 2, np.full(n, 3)
    s = SourceMixture(labels, sizes, sources=sources, source_weights=[1, 1], block_size=4, document_tokens=tokens,
                      inner=functools.partial(DynamicSampler, warmup_steps=0, update_every=1))
    assert s.needs_feedback
    s.next_block()
    s.observe(0, np.array([40.0, 1.0, 1.0, 1.0]), np.array([1, 1, 1, 1]))
    assert [p.steps_since_warmup() for p in s._inner.values()] == [1, 1]  # every source's policy saw the step
    assert not SourceMixture(labels, sizes, sources=sources, source_weights=[1, 1], inner=UniformSampler,
                             document_tokens=tokens).needs_feedback
    with pytest.raises(CcexpError, match="cannot run inside sources"):
        SourceMixture(labels, sizes, sources=sources, source_weights=[1, 1], document_tokens=tokens,
                      inner=functools.partial(ClusterDPSampler, keep="random"))


@pytest.mark.parametrize("weights,message", [
    ([-1.0, 2.0], "must be >= 0"),
    ([0.0, 0.0], "every source weight is 0"),
    ([float("nan"), 1.0], "finite numbers"),
    ([float("inf"), 1.0], "finite numbers"),
    ([1.0], r"source ids must lie in \[0, 1\)"),
    ([], "non-empty list"),
    ("web", "not numbers"),
    ([1.0, 1.0, 1.0], "source\\(s\\) 2 have weight > 0 but no training documents"),
])
def test_bad_weights_are_one_line_errors(weights, message):
    labels = np.zeros(6, np.int32)
    with pytest.raises(CcexpError, match=message) as e:
        SourceMixture(labels, np.array([6]), sources=np.arange(6) % 2, source_weights=weights, inner=UniformSampler,
                      document_tokens=np.ones(6, np.int64))
    assert "\n" not in str(e.value)


def test_a_weight_zero_source_needs_no_documents_and_is_never_drawn():
    labels = np.zeros(6, np.int32)
    s = SourceMixture(labels, np.array([6]), sources=np.arange(6) % 2, source_weights=[0, 1, 0],
                      inner=UniformSampler, document_tokens=np.ones(6, np.int64), block_size=5)
    docs = np.concatenate([s.next_block() for _ in range(10)])
    assert (docs % 2 == 1).all()
    assert s.repetition_histogram()[0] >= 3  # the weight-0 source's documents are counted, never drawn


@pytest.mark.parametrize("bad,message", [
    (dict(sources=np.arange(5)), "one integer source id per document"),
    (dict(sources=np.full(6, 0.5)), "one integer source id per document"),
    (dict(sources=np.array([0, 1, 0, 1, 0, -1])), r"must lie in \[0, 2\)"),
    (dict(document_tokens=None), "needs document_tokens"),
])
def test_bad_sources_are_one_line_errors(bad, message):
    kw = dict(sources=np.arange(6) % 2, source_weights=[1, 1], inner=UniformSampler,
              document_tokens=np.ones(6, np.int64)) | bad
    with pytest.raises(CcexpError, match=message):
        SourceMixture(np.zeros(6, np.int32), np.array([6]), **kw)
