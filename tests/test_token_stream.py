"""The global token stream (DESIGN.md, "tokens are the unit of a step"): every policy's documents
packed into full rows, exactly ``tokens_per_step`` targets per step, nothing lost, the same stream for
any world size, exact resume, counted truncation, and per-document attention."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.data.packing import TokenStream, stream_lengths
from ccexp.sampling import (ClusterClipSampler, ClusterDPSampler, DynamicSampler, MixtureSampler, RandomSampler,
                            TemperatureSampler, UniformSampler, UniMaxSampler, rank_slice)
from helpers import source_mixture_factory

EOS = 0
POLICIES = [
    (RandomSampler, {}),
    (UniformSampler, {}),
    (ClusterClipSampler, dict(clip_threshold=3, on_exhausted="reset")),
    (ClusterClipSampler, dict(clip_threshold=2, after_clip="proportional", on_exhausted="reset")),
    (DynamicSampler, dict(warmup_steps=2, update_every=1)),
    (ClusterDPSampler, dict(keep="random")),
    (TemperatureSampler, dict(alpha=0.5)),
    (UniMaxSampler, dict(max_epochs=2, on_exhausted="reset")),
    (MixtureSampler, dict(weights=[0.1, 0.2, 0.3, 0.4], max_repetitions=2, on_exhausted="reset")),
    (source_mixture_factory(ClusterClipSampler, clip_threshold=3, on_exhausted="reset"), {}),
]


def corpus(n=60, k=4, seed=0, max_len=40):
    """Documents with random lengths; token ``1000·(d+1) + i`` is token i of document d (never EOS)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate([1000 * (d + 1) + np.arange(n_d) for d, n_d in enumerate(lengths)]).astype(np.int64)
    labels = rng.permutation(np.arange(n) % k).astype(np.int32)
    return tokens, offsets, labels, np.bincount(labels, minlength=k).astype(np.int64)


def make_stream(cls, kw, *, rows=8, seq_len=16, seed=3, max_doc_tokens=None, n=60):
    tokens, offsets, labels, sizes = corpus(n=n)
    sampler = cls(labels, sizes, block_size=5, seed=seed, **kw)
    stream = TokenStream(sampler, np.diff(offsets), seq_len=seq_len, rows_per_step=rows, max_doc_tokens=max_doc_tokens)
    return stream, tokens, offsets


def step_rows(stream, tokens, offsets, rows=None, document_mask=False):
    plan = stream.plan_step()
    rows = np.arange(stream.rows_per_step) if rows is None else rows
    out = stream.rows(plan, rows, tokens=tokens, offsets=offsets, corpus_index=np.arange(offsets.size - 1),
                      eos_id=EOS, document_mask=document_mask)
    feedback(stream, plan)
    return out


def feedback(stream, plan):
    """A per-cluster signal that depends on what the step drew, as the all-reduced training loss does."""
    count = np.bincount(stream.sampler.labels[plan.doc], minlength=stream.sampler.num_clusters)
    stream.sampler.observe(plan.step, count * (1.0 + np.arange(count.size) % 3), count)


@pytest.mark.parametrize("cls,kw", POLICIES)
def test_every_step_is_full_rows_whose_labels_are_the_next_tokens(cls, kw):
    stream, tokens, offsets = make_stream(cls, kw)
    for _ in range(12):
        out = step_rows(stream, tokens, offsets)
        assert out["input_ids"].shape == out["labels"].shape == (8, 16)  # 128 targets = tokens_per_step
        lanes = stream.row_lane
        for lane in np.unique(lanes):  # within a lane, each row's last label is the next row's first input
            ids = out["input_ids"][lanes == lane]
            lab = out["labels"][lanes == lane]
            assert torch.equal(lab[:, :-1], ids[:, 1:]) and torch.equal(lab[:-1, -1], ids[1:, 0])


def expected_stream(cls, kw, tokens, offsets, lane, n_docs, seed=3, cap=None):
    """The lane's document stream drawn by a twin sampler, written out as separator + tokens."""
    _, _, labels, sizes = corpus()
    twin = cls(labels, sizes, block_size=5, seed=seed, **kw)
    docs = np.concatenate([twin.next_block(lane) for _ in range(-(-n_docs // 5))])
    parts = [np.concatenate([[EOS], tokens[offsets[d]:offsets[d + 1]][:cap]]) for d in docs]
    return np.concatenate(parts)


@pytest.mark.parametrize("cls,kw", [p for p in POLICIES if p[0] is not DynamicSampler])
def test_no_token_of_any_document_is_lost_or_reordered(cls, kw):
    stream, tokens, offsets = make_stream(cls, kw)
    got = {lane: [] for lane in range(stream.sampler.num_lanes)}
    for _ in range(15):
        out = step_rows(stream, tokens, offsets)
        for lane in got:
            got[lane].append(out["input_ids"][stream.row_lane == lane].reshape(-1).numpy())
    for lane, parts in got.items():
        flat = np.concatenate(parts)
        assert np.array_equal(flat, expected_stream(cls, kw, tokens, offsets, lane, 200)[:flat.size])


def test_over_a_full_pass_each_document_trains_on_all_its_tokens():
    """Random sampling, a budget of exactly one epoch: every document's targets = its tokens + 1 (the
    prediction of its end), none more, none fewer."""
    tokens, offsets, labels, sizes = corpus(n=50)
    lengths = np.diff(offsets)
    total = int(stream_lengths(lengths).sum())
    seq_len, rows = 8, 4
    lengths[-1] += (-total) % (seq_len * rows)  # make the epoch a whole number of steps
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(1, offsets[-1] + 1)
    stream = TokenStream(RandomSampler(labels, sizes, block_size=7, seed=1), lengths, seq_len=seq_len,
                         rows_per_step=rows)
    trained = np.zeros(labels.size, np.int64)
    for _ in range(int(stream_lengths(lengths).sum()) // (seq_len * rows)):
        out = step_rows(stream, tokens, offsets)
        trained += np.bincount(out["doc_ids"].numpy().ravel(), minlength=labels.size)
    assert np.array_equal(trained, lengths + 1)
    assert stream.documents_started == labels.size and stream.truncated_tokens == 0


@pytest.mark.parametrize("cls,kw", POLICIES)
@pytest.mark.parametrize("world_size,micro", [(2, 2), (4, 1), (4, 2)])
def test_rank_micro_batches_reassemble_the_single_process_stream(cls, kw, world_size, micro):
    single, tokens, offsets = make_stream(cls, kw)
    ranks = [make_stream(cls, kw)[0] for _ in range(world_size)]
    for _ in range(8):
        reference = step_rows(single, tokens, offsets)["input_ids"]
        parts = []
        for r, stream in enumerate(ranks):  # every rank plans the whole step, materialises only its rows
            plan = stream.plan_step()
            mine = rank_slice(np.arange(8), r, world_size)
            for j in range(0, mine.size, micro):
                parts.append(stream.rows(plan, mine[j:j + micro], tokens=tokens, offsets=offsets,
                                         corpus_index=np.arange(offsets.size - 1), eos_id=EOS,
                                         document_mask=False)["input_ids"])
            feedback(stream, plan)  # every rank observes the same all-reduced signal
        assert torch.equal(torch.cat(parts), reference)


@pytest.mark.parametrize("cls,kw", POLICIES)
@settings(max_examples=10, deadline=None)
@given(stop=st.integers(0, 12))
def test_resume_from_state_continues_the_same_tokens(cls, kw, stop):
    full, tokens, offsets = make_stream(cls, kw)
    reference = [step_rows(full, tokens, offsets)["input_ids"] for _ in range(15)]
    first, _, _ = make_stream(cls, kw)
    for _ in range(stop):
        step_rows(first, tokens, offsets)
    sampler_state, stream_state = first.sampler.state_dict(), first.state_dict()
    resumed, _, _ = make_stream(cls, kw)
    resumed.sampler.load_state_dict(sampler_state)
    resumed.load_state_dict(stream_state)
    for t in range(stop, 15):
        assert torch.equal(step_rows(resumed, tokens, offsets)["input_ids"], reference[t])


def test_a_cap_drops_the_tail_of_long_documents_and_counts_it():
    stream, tokens, offsets = make_stream(UniformSampler, {}, max_doc_tokens=10)
    lengths = np.diff(offsets)
    started = []
    for _ in range(10):
        out = step_rows(stream, tokens, offsets)
        ids = out["input_ids"].numpy().ravel()
        started.append(out["doc_ids"].numpy().ravel()[ids == EOS])  # a consumed separator starts its document
        position = np.where(ids == EOS, -1, ids % 1000)  # position of each token inside its document
        assert position.max() < 10  # nothing past the cap is ever trained on
    docs = np.concatenate(started)
    assert stream.documents_started == docs.size
    assert stream.truncated_tokens == int(np.maximum(lengths[docs] - 10, 0).sum()) > 0


def test_cluster_dp_fills_each_clusters_rows_from_its_own_stream():
    stream, tokens, offsets = make_stream(ClusterDPSampler, dict(keep="random"))
    labels = stream.sampler.labels
    for _ in range(5):
        out = step_rows(stream, tokens, offsets)
        clusters = out["cluster_ids"].numpy()
        for rank in range(4):  # K = 4 = world size: rank r's rows hold only cluster r's tokens
            assert (rank_slice(clusters, rank, 4) == rank).all()
        assert np.array_equal(np.bincount(clusters.ravel(), minlength=4), np.full(4, 32))
        assert (labels[out["doc_ids"].numpy()] == clusters).all()


def test_document_mask_positions_restart_at_every_document_and_row():
    stream, tokens, offsets = make_stream(UniformSampler, {})
    out = step_rows(stream, tokens, offsets, document_mask=True)
    pos, ids, doc = out["position_ids"].numpy(), out["input_ids"].numpy(), out["doc_ids"].numpy()
    assert (pos[:, 0] == 0).all()
    new_doc = np.zeros_like(pos, dtype=bool)
    new_doc[:, 1:] = (ids[:, 1:] == EOS) | (doc[:, 1:] != doc[:, :-1])
    assert (pos[new_doc] == 0).all() and (pos[:, 1:][~new_doc[:, 1:]] == pos[:, :-1][~new_doc[:, 1:]] + 1).all()


def test_packed_row_with_document_mask_scores_each_document_as_if_alone():
    """A real GPT-2: per-document losses inside a packed row (block-diagonal attention through per-document
    position ids) equal the same documents scored one by one from their separator."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=EOS, eos_token_id=EOS)).eval()
    docs = [np.array([5, 9, 3, 7]), np.array([11, 2]), np.array([4, 4, 8, 30, 31, 6])]
    row = np.concatenate([np.concatenate([[EOS], d]) for d in docs] + [[EOS]])  # the last EOS: the final target
    inputs, labels = torch.tensor(row[:-1])[None], torch.tensor(row[1:])[None]
    starts = np.cumsum([0] + [d.size + 1 for d in docs[:-1]])
    position = np.arange(inputs.shape[1]) - np.repeat(starts, [d.size + 1 for d in docs])
    with torch.no_grad():
        packed = torch.nn.functional.cross_entropy(model(input_ids=inputs, position_ids=torch.tensor(position)[None],
                                                         use_cache=False).logits[0], labels[0], reduction="none")
        plain = torch.nn.functional.cross_entropy(model(input_ids=inputs, use_cache=False).logits[0], labels[0],
                                                  reduction="none")
        for d, s in zip(docs, starts):
            alone = torch.tensor(np.concatenate([[EOS], d, [EOS]]))
            expect = torch.nn.functional.cross_entropy(model(input_ids=alone[None, :-1], use_cache=False).logits[0],
                                                       alone[1:], reduction="none")
            torch.testing.assert_close(packed[s:s + d.size + 1], expect, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed[starts[1]:], plain[starts[1]:], atol=1e-4)  # without the mask, context leaks


def test_lightning_accumulates_micro_batches_and_the_policy_observes_each_step_once(tmp_path):
    """A real Lightning fit: 3 steps of 4 micro-batches; ``observe`` runs once per optimizer step with the
    per-cluster sums of all its micro-batches (exactly tokens_per_step tokens), and the LR schedule and
    checkpoints count optimizer steps."""
    import lightning as L

    from ccexp.training.data import SamplerDataModule
    from ccexp.training.module import CausalLMModule
    from transformers import GPT2Config, GPT2LMHeadModel

    tokens, offsets, labels, sizes = corpus()
    tokens = tokens % 50 + 1  # a small vocabulary (0 stays the separator)

    class Recording(UniformSampler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.seen = []

        def observe(self, step, cluster_loss, cluster_tokens):
            self.seen.append((step, int(np.sum(cluster_tokens)), float(np.sum(cluster_loss))))

    sampler = Recording(labels, sizes, block_size=5, seed=0)
    stream = TokenStream(sampler, np.diff(offsets), seq_len=16, rows_per_step=8)
    dm = SamplerDataModule(stream, np.arange(labels.size), tokens, offsets, total_steps=3, micro_batch_size=2,
                           grad_accumulation=4, eos_id=EOS)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=EOS, eos_token_id=EOS))
    module = CausalLMModule(model, int(sizes.size), sampler=sampler, lr=1e-3, weight_decay=0.0, total_steps=3,
                            warmup_steps=1)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3 and [s for s, _, _ in sampler.seen] == [0, 1, 2]
    assert all(n == 128 for _, n, _ in sampler.seen)  # 8 rows x 16 targets, summed over 4 micro-batches
    assert module.tokens_seen == 3 * 128 and int(module.cluster_tokens.sum()) == 3 * 128
