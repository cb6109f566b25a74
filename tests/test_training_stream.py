"""The document stream through real Lightning runs: exact resume from a real checkpoint, and the same
global stream for one process and for two gloo processes (``ddp_spawn`` on CPU)."""
from __future__ import annotations

import numpy as np
import pytest
from mlflow import MlflowClient

from conftest import run_ccexp

TINY = ["data=jsonl", "clusterer.k=4", "train.steps=12", "train.global_batch_size=8", "train.seq_len=64",
        "train.max_doc_tokens=64", "train.warmup_steps=2", "eval.max_tokens=32", "model.n_embd=32", "model.n_head=2",
        "model.n_layer=1", "model.tokenizer.vocab_size=512", "trainer.enable_progress_bar=false",
        "train.record_batches=true", "trainer.threads=1"]


def run(tmp_path, corpus, name, *extra):
    out = tmp_path / name
    proc = run_ccexp(f"data.path={corpus}", f"paths.outputs={tmp_path / 'store'}",
                     f"hydra.run.dir={out}", *TINY, *extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def batches(run_dir, rank=0):
    z = np.load(run_dir / "batches" / f"rank{rank}.npz")
    return z["steps"], z["docs"], z["global_docs"]


def final_ppl(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp")
    return [r.data.metrics["eval/ppl"] for r in client.search_runs([exp.experiment_id],
                                                                   order_by=["attributes.start_time ASC"])]


@pytest.mark.parametrize("sampler", [["sampler=clusterclip", "sampler.clip_threshold=3"],
                                     ["sampler=dynamic", "sampler.warmup_steps=2", "sampler.update_every=2"]])
def test_resume_from_a_lightning_checkpoint_continues_the_same_stream(tmp_path, small_corpus, sampler):
    full = run(tmp_path, small_corpus, "full", *sampler, "train.checkpoint_every_n_steps=5")
    ckpt = full / "checkpoints" / "step-5.ckpt"
    assert ckpt.is_file()
    resumed = run(tmp_path, small_corpus, "resumed", *sampler, f"train.resume_from={ckpt}")
    steps_full, docs_full, _ = batches(full)
    steps_res, docs_res, _ = batches(resumed)
    assert steps_full.tolist() == list(range(12)) and steps_res.tolist() == list(range(5, 12))
    assert np.array_equal(docs_res, docs_full[5:])
    ppl_full, ppl_resumed = final_ppl(tmp_path)
    assert ppl_resumed == pytest.approx(ppl_full, rel=1e-4)  # same data, same optimizer state: same model


def test_two_gloo_processes_train_on_the_single_process_stream(tmp_path, small_corpus):
    sampler = ["sampler=clusterclip", "sampler.clip_threshold=3"]
    single = run(tmp_path, small_corpus, "single", *sampler)
    ddp = run(tmp_path, small_corpus, "ddp", *sampler, "trainer.devices=2", "trainer.strategy=ddp_spawn")
    steps, docs, _ = batches(single)
    s0, d0, g0 = batches(ddp, 0)
    s1, d1, g1 = batches(ddp, 1)
    assert s0.tolist() == s1.tolist() == steps.tolist()
    assert np.array_equal(np.concatenate([d0, d1], axis=1), docs)  # rank r trains on slice r of the same batch
    assert np.array_equal(g0, g1)


def test_dynamic_weights_stay_in_sync_across_ranks(tmp_path, small_corpus):
    ddp = run(tmp_path, small_corpus, "ddp_dyn", "sampler=dynamic", "sampler.warmup_steps=2", "sampler.update_every=1",
              "trainer.devices=2", "trainer.strategy=ddp_spawn")
    _, _, g0 = batches(ddp, 0)
    _, _, g1 = batches(ddp, 1)
    assert np.array_equal(g0, g1)  # both ranks' samplers saw the same all-reduced per-cluster loss
