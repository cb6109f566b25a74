"""The token stream through real Lightning runs: exact resume from a real checkpoint (with gradient
accumulation and the carry-over of documents between steps), and the same global stream for one
process and for two gloo processes (``ddp_spawn`` on CPU)."""
from __future__ import annotations

import numpy as np
import pytest
from mlflow import MlflowClient

from conftest import run_ccexp

TINY = ["data=jsonl", "clusterer.k=4", "train.steps=12", "train.tokens_per_step=512", "train.micro_batch_size=2",
        "train.seq_len=64", "train.warmup_steps=2", "eval.max_tokens=32", "model.n_embd=32", "model.n_head=2",
        "model.n_layer=1", "model.tokenizer.vocab_size=512", "trainer.enable_progress_bar=false",
        "train.record_batches=true", "trainer.threads=1"]


def run(tmp_path, corpus, name, *extra):
    out = tmp_path / name
    proc = run_ccexp(f"data.path={corpus}", f"paths.outputs={tmp_path / 'store'}",
                     f"hydra.run.dir={out}", *TINY, *extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def batches(run_dir, rank=0):
    """{(step, row): input_ids of that row} as recorded by one rank, and the steps in training order."""
    z = np.load(run_dir / "batches" / f"rank{rank}.npz")
    rows = {(int(t), int(r)): ids for t, rs, block in zip(z["steps"], z["rows"], z["input_ids"])
            for r, ids in zip(rs, block)}
    return rows, z["steps"]


def final_tokens(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp")
    return [r.data.metrics["train/tokens"] for r in client.search_runs([exp.experiment_id],
                                                                       order_by=["attributes.start_time ASC"])]


def final_ppl(tmp_path, metric="eval/ppl"):
    client = MlflowClient(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp")
    return [r.data.metrics[metric] for r in client.search_runs([exp.experiment_id],
                                                               order_by=["attributes.start_time ASC"])]


@pytest.mark.parametrize("sampler", [["sampler=clusterclip", "sampler.clip_threshold=3"],
                                     ["sampler=dynamic", "sampler.warmup_steps=2", "sampler.update_every=2"]])
def test_resume_from_a_lightning_checkpoint_continues_the_same_stream(tmp_path, small_corpus, sampler):
    full = run(tmp_path, small_corpus, "full", *sampler, "train.checkpoint_every_n_steps=5", "eval.average=ema")
    ckpt = full / "checkpoints" / "step-5.ckpt"
    assert ckpt.is_file()
    resumed = run(tmp_path, small_corpus, "resumed", *sampler, f"train.resume_from={ckpt}", "eval.average=ema")
    rows_full, steps_full = batches(full)
    rows_res, steps_res = batches(resumed)
    # 8 rows per step in micro-batches of 2: 4 micro-batches (gradient accumulation) per step
    assert steps_full.tolist() == [t for t in range(12) for _ in range(4)]
    assert steps_res.tolist() == [t for t in range(5, 12) for _ in range(4)]
    assert rows_res.keys() == {k for k in rows_full if k[0] >= 5}
    assert all(np.array_equal(rows_res[k], rows_full[k]) for k in rows_res)
    ppl_full, ppl_resumed = final_ppl(tmp_path, "eval/final/ppl")
    assert ppl_resumed == pytest.approx(ppl_full, rel=1e-4)  # same data, same optimizer state: same model
    ema_full, ema_resumed = final_ppl(tmp_path)  # the headline: the averaged weights, saved in the checkpoint
    assert ema_resumed == pytest.approx(ema_full, rel=1e-4) and ema_full != ppl_full


@pytest.mark.slow
def test_two_gloo_processes_train_on_the_single_process_stream(tmp_path, small_corpus):
    sampler = ["sampler=clusterclip", "sampler.clip_threshold=3"]
    single = run(tmp_path, small_corpus, "single", *sampler)
    ddp = run(tmp_path, small_corpus, "ddp", *sampler, "trainer.devices=2", "trainer.strategy=ddp_spawn")
    rows, _ = batches(single)
    r0, s0 = batches(ddp, 0)
    r1, s1 = batches(ddp, 1)
    assert s0.tolist() == s1.tolist() == [t for t in range(12) for _ in range(2)]  # 2 micro-batches per rank
    assert {r for _, r in r0} == {0, 1, 2, 3} and {r for _, r in r1} == {4, 5, 6, 7}  # contiguous row slices
    assert {**r0, **r1}.keys() == rows.keys()
    assert all(np.array_equal({**r0, **r1}[k], rows[k]) for k in rows)  # the same tokens in the same rows
    assert final_tokens(tmp_path) == [12 * 512, 12 * 512]


@pytest.mark.slow
def test_dynamic_weights_stay_in_sync_across_ranks(tmp_path, small_corpus):
    ddp = run(tmp_path, small_corpus, "ddp_dyn", "sampler=dynamic", "sampler.warmup_steps=2", "sampler.update_every=1",
              "trainer.devices=2", "trainer.strategy=ddp_spawn")
    z0, z1 = (np.load(ddp / "batches" / f"rank{r}.npz") for r in (0, 1))
    # every rank plans the whole step from its own sampler: identical plans mean identical weights, i.e. both
    # samplers saw the same all-reduced per-cluster loss
    assert np.array_equal(z0["plan_digest"], z1["plan_digest"]) and len(set(z0["plan_digest"].tolist())) == 12
