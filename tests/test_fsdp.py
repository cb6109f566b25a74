"""FSDP on the CPU (gloo, ``device_id=cpu``): the headline command, ``+recipe=llama2_7b``, with a tiny Llama folder
made here with ``save_pretrained``. One rank and two ranks (torchrun) train, score the held-out split sharded, run
lm-eval on the exported model and record the run; their final weights and held-out scores equal a plain
``trainer.strategy=auto`` run on the same tokens. A run stopped by SIGTERM continues bit for bit; a checkpoint killed
mid-write leaves the previous one whole. A model built with its parameters on the meta device and its buffers
computed equals a normally built one (Llama, GPT-2), and every recipe composes with every option of every group."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ccexp.errors import CcexpError
from conftest import ROOT, run_ccexp
from test_config_and_cli import GROUP_OPTIONS, compose_cfg
from test_multinode import env, finish, free_port, start, torchrun

RECIPES = sorted(p.stem for p in (ROOT / "ccexp" / "conf" / "recipe").glob("*.yaml"))


def tiny_llama(out: Path, hidden: int = 64) -> Path:
    """A real Hugging Face Llama folder: random weights (seed 0), a locally trained byte-level BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ccexp.data.tokenize import train_bpe_tokenizer

    texts = ["the cat sat on the mat", "define the word entity", "answer: a thing that exists"] * 50
    tok = train_bpe_tokenizer(texts, 300, out)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


# -- a model built on meta equals a normally built one ----------------------------------------------------------------
def _architectures():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    return {"llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, max_position_embeddings=64,
                                                          rope_theta=500.0)),
            "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64))}


def _same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Every buffer (persistent or not) and every parameter equal, and the logits of one input equal."""
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert buffers_a.keys() == buffers_b.keys()
    for name, buf in buffers_a.items():
        assert not buf.is_meta and buf.device == buffers_b[name].device and torch.equal(buf, buffers_b[name]), name
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    ids = torch.arange(1, 41).remainder(96).view(2, 20)
    with torch.no_grad():
        assert torch.equal(a.eval()(input_ids=ids).logits, b.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_model_built_on_meta_and_loaded_equals_a_normally_built_one(arch):
    from ccexp.training.distributed import empty_model

    build = _architectures()[arch]
    torch.manual_seed(0)
    reference = build()
    empty = empty_model(build)
    assert all(p.is_meta for p in empty.parameters()) and not any(b.is_meta for b in empty.buffers())
    empty.load_state_dict(reference.state_dict(), assign=True, strict=True)
    empty.tie_weights()
    _same_model(empty, reference)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_model_materialised_as_a_rank_other_than_0_equals_rank_0s_once_its_parameters_arrive(arch):
    """The path of ``load_weights=rank0``: parameters materialised empty (FSDP's ``param_init_fn``), then their
    values copied in (the broadcast); the buffers are right because they were computed, never copied."""
    from ccexp.training.distributed import empty_model, materialise_parameters

    build = _architectures()[arch]
    torch.manual_seed(0)
    reference = build()
    empty = empty_model(build)
    materialise_parameters(empty, torch.device("cpu"))
    assert arch != "gpt2" or empty.lm_head.weight is empty.transformer.wte.weight  # still tied
    with torch.no_grad():
        for p, q in zip(empty.parameters(), reference.parameters()):
            p.copy_(q)
    _same_model(empty, reference)


def test_the_pretrained_builder_of_ranks_other_than_0_computes_the_rotary_buffers(llama_folder):
    from ccexp.training.models import hf_causal_lm

    loaded, empty = hf_causal_lm(str(llama_folder)), hf_causal_lm(str(llama_folder), empty=True)
    assert all(p.is_meta for p in empty.parameters()) and empty.training
    rotary = {n: b for n, b in empty.named_buffers() if "inv_freq" in n}
    assert rotary and all(torch.equal(b, dict(loaded.named_buffers())[n]) for n, b in rotary.items())


# -- sharded scoring ---------------------------------------------------------------------------------------------------
SCORE_SCRIPT = textwrap.dedent("""
    import os, sys, numpy as np, torch, torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    from ccexp.evaluation.perplexity import document_nll
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 20, size=23)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(1, 50, size=int(offsets[-1])).astype(np.int32)
    args = dict(eos_id=0, pad_id=0, max_tokens=16, batch_size=4)
    nll, ntok = document_nll(model, tokens, offsets, np.arange(23), ranks=(rank, world), **args)
    one, ntok1 = document_nll(model, tokens, offsets, np.arange(23), **args)
    assert np.array_equal(nll, one) and np.array_equal(ntok, ntok1), np.abs(nll - one).max()
    np.save(f"nll-{world}-{rank}.npy", nll)
""")


def test_held_out_scores_shared_over_ranks_equal_one_process_bit_for_bit(tmp_path):
    """23 documents in 6 batches over 2 ranks (3 each) and 4 ranks (one with a batch fewer, which keeps in step
    with a forward pass of its own): every rank ends with every document's NLL, equal to one process's."""
    script = tmp_path / "score.py"
    script.write_text(SCORE_SCRIPT)
    for world in (2, 4):
        port = free_port()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                               f"--master-port={port}", str(script)], cwd=tmp_path, env=env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        got = [np.load(tmp_path / f"nll-{world}-{rank}.npy") for rank in range(world)]
        assert all(np.array_equal(g, got[0]) for g in got) and np.all(got[0] > 0)


# -- recipes compose ---------------------------------------------------------------------------------------------------
@functools.cache
def _plain_option(group: str, option: str) -> dict:
    """``<group>=<option>`` without a recipe, composed once for every recipe's test (a container: never mutated)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose_cfg([f"{group}={option}"])[group])


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_with_every_option_of_every_group(recipe):
    """A recipe sets a group's keys only through its own option of that group (``<group>/recipe/<recipe>.yaml``), so
    ``+recipe=llama2_7b clusterer=labels`` (or eval=default, trainer=cpu, ...) is that option with its own defaults,
    never the recipe's k-means keys on a LabelGroupsConfig."""
    from ccexp import config as schemas
    from ccexp.preflight import _check_keys_and_bounds

    from omegaconf import OmegaConf

    for group, options in GROUP_OPTIONS.items():
        for option in options:
            cfg = compose_cfg([f"+recipe={recipe}", f"{group}={option}"])
            _check_keys_and_bounds(cfg, schemas.RootConfig, "")
            assert cfg[group].name == option or group == "model", (group, option)
            assert cfg.recipe_name == recipe
            if group != "logger":  # the option the user picks is whole: none of the recipe's keys of that group
                # (logger.experiment, every logger's, is the recipe's)
                assert OmegaConf.to_container(cfg[group]) == _plain_option(group, option), (group, option)
    assert compose_cfg([f"+recipe={recipe}", "eval=default"]).eval.lm_eval is None


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipes_cfg_job_and_memory_plan_run(recipe, tmp_path, capsys):
    from ccexp.plan import main as plan_main

    proc = run_ccexp(f"+recipe={recipe}", "--cfg", "job", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and f"recipe_name: {recipe}" in proc.stdout, proc.stderr[-2000:]
    assert plan_main(["model", f"+recipe={recipe}", "--gpu-gb", "80"]) in (0, 1)
    out = capsys.readouterr().out
    for phase in ("embedding", "training", "evaluation", "lm-eval"):
        assert f"{phase:<12}" in out, out


# -- a checkpoint written whole or not at all -------------------------------------------------------------------------
KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch, torch.distributed as dist
    from pathlib import Path
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch import LightningModule, Trainer
    from ccexp.training.distributed import FSDPStrategy

    class M(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)
        def training_step(self, batch, i):
            return self.layer(batch).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.ones(4, 8), batch_size=2)

    out = Path(sys.argv[1])
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=int(sys.argv[2]), strategy=FSDPStrategy(
        state_dict_type="sharded"), logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(M())
    if sys.argv[3] == "kill":  # die in the middle of the next save: its shards written, nothing renamed
        def killed(*args, **kwargs):
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        real, dcp.save = dcp.save, killed
    trainer.save_checkpoint(out / "last.ckpt")
""")


def test_a_sharded_checkpoint_killed_mid_write_leaves_the_previous_one_whole(tmp_path):
    from ccexp.launch.resume import unreadable

    script = tmp_path / "save.py"
    script.write_text(KILL_SCRIPT)
    ckpt = tmp_path / "ckpt"
    ok = subprocess.run([sys.executable, str(script), str(ckpt), "2", "save"], env=env(), capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert unreadable(ckpt / "last.ckpt") is None
    assert torch.load(ckpt / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 2
    killed = subprocess.run([sys.executable, str(script), str(ckpt), "3", "kill"], env=env(), capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # the new shards lie in a temporary folder no resume reads; the previous checkpoint is whole, in place
    (partial,) = [p for p in ckpt.iterdir() if p.name.startswith(".last.ckpt.tmp-")]
    assert (partial / ".metadata").is_file() and not (partial / "meta.pt").exists()
    assert unreadable(partial) == "a sharded checkpoint folder without its meta.pt"
    assert unreadable(ckpt / "last.ckpt") is None
    assert torch.load(ckpt / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in ckpt.glob("*.ckpt")) == ["last.ckpt"]


# -- a tokenizer the model cannot embed --------------------------------------------------------------------------------
def test_a_tokenizer_with_more_tokens_than_the_models_embedding_is_refused(llama_folder, tmp_path):
    from ccexp.data.tokenize import load_tokenizer, train_bpe_tokenizer
    from ccexp.model_source import check_vocabulary

    model = compose_cfg(["model=hf_causal_lm", f"model.pretrained={llama_folder}"]).model
    check_vocabulary(model, str(llama_folder), load_tokenizer(llama_folder))
    big = train_bpe_tokenizer([f"word{i} and more words {i * 7}" for i in range(400)], 600, tmp_path / "big")
    with pytest.raises(CcexpError, match=r"its own tokenizer has \d{3} tokens but its embedding 299 rows"):
        check_vocabulary(model, str(llama_folder), big)  # the folder's own tokenizer: the folder is inconsistent
    bpe = compose_cfg(["model=hf_causal_lm", f"model.pretrained={llama_folder}", "model.tokenizer.kind=bpe"]).model
    with pytest.raises(CcexpError, match=r"embeds 299 token ids, but the tokenizer \(model.tokenizer.kind=bpe\) "
                                         r"has \d{3} tokens; use the model's own tokenizer"):
        check_vocabulary(bpe, str(llama_folder), big)


# -- the headline command on the CPU, end to end -------------------------------------------------------------------------
def recipe_overrides(folder: Path, out: Path, *extra: str) -> list[str]:
    """``+recipe=llama2_7b`` on the tiny Llama, small enough for a CPU: 600 documents, 8 clusters, 6 steps of 4
    rows of 64 tokens (2 micro-batches of 2 rows on one rank, 1 on each of two), fp32, the model's own tokenizer,
    gradient clipping off (FSDP's clip sums per-rank norms in another order than one process's: its last bits
    differ with two ranks), lm-eval's local tasks on a few documents."""
    return ["+recipe=llama2_7b", "data=builtin", "data.max_documents=600", f"model.pretrained={folder}",
            "model.architecture=null", "trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.threads=1",
            "trainer.gradient_clip_val=null", "clusterer.k=8", "train.steps=6", "train.seq_len=64",
            "train.tokens_per_step=256", "train.micro_batch_size=2", "train.warmup_steps=1", "train.log_every_n_steps=1",
            "eval.max_tokens=64", "eval.every_n_steps=3", "eval.curve_documents=16", "eval.lm_eval.tasks=[]",
            "eval.lm_eval.max_docs_per_task=4", "eval.lm_eval.mc_docs=4", "eval.lm_eval.batch_size=4",
            "train.save_model=true", f"paths.outputs={out}", f"paths.cache={out.parent / 'cache'}", *extra]


def weights(model_folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model_folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def finished_run(out: Path) -> tuple[Path, object]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ccexp-llama2_7b").experiment_id])
    (folder,) = [p.parent for p in out.glob("runs/*/*/run.json")]
    return folder, run


def launch(way: str, folder: Path, out: Path, *extra: str, timeout: float = 900) -> str:
    """``python -m ccexp`` (``plain``: strategy auto; ``fsdp1``: FSDP on one rank) or torchrun with 2 ranks
    (``fsdp2``); its log."""
    args = recipe_overrides(folder, out, *extra)
    log = out.parent / f"{out.name}.log"
    if way == "fsdp2":
        port = free_port()
        cmd = torchrun(1, 2, port, f"{out.name}-{port}", *args, "trainer.devices=2")
    else:
        cmd = [sys.executable, "-m", "ccexp", *args, "trainer.devices=1",
               *(["trainer.strategy=auto"] if way == "plain" else [])]
    return finish([start(cmd, out.parent / f"{out.name}-cwd", log)], [log], timeout)[0]


@pytest.fixture(scope="module")
def three_ways(llama_folder, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    outs = {}
    for way in ("plain", "fsdp1", "fsdp2"):
        outs[way] = root / way
        text = launch(way, llama_folder, outs[way])
        assert "done: " in text, f"{way}:\n{text[-4000:]}"
    return outs


@pytest.mark.slow
def test_the_llama2_7b_recipe_under_fsdp_on_the_cpu_trains_evaluates_and_records_its_run(three_ways):
    for way in ("fsdp1", "fsdp2"):
        folder, run = finished_run(three_ways[way])
        assert run.info.status == "FINISHED" and run.data.params["trainer.strategy"] == "fsdp"
        assert {"macro ppl", "eval/ppl", "curve/ppl"} <= set(run.data.metrics)
        assert any(k.startswith("lm_eval/ccexp_continuation") for k in run.data.metrics), sorted(run.data.metrics)
        assert not [k for k in run.data.tags if k.startswith("eval_error/")]
        assert (folder / "tables" / "heldout_documents.csv").is_file() and (folder / "model" / "config.json").is_file()
        assert json.loads((folder / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_fsdp_on_one_and_two_cpu_ranks_ends_with_the_weights_and_held_out_scores_of_a_plain_run(three_ways):
    import pandas as pd

    plain = finished_run(three_ways["plain"])[0]
    reference, scores = weights(plain / "model"), pd.read_csv(plain / "tables" / "heldout_documents.csv")
    for way in ("fsdp1", "fsdp2"):
        folder = finished_run(three_ways[way])[0]
        got = weights(folder / "model")
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in reference), way
        assert pd.read_csv(folder / "tables" / "heldout_documents.csv").equals(scores), way


@pytest.mark.slow
def test_fsdp_stopped_by_sigterm_after_a_sharded_checkpoint_continues_bit_for_bit(llama_folder, three_ways, tmp_path):
    """Two ranks, stopped by SIGTERM once the step-2 sharded checkpoint is there; the same command continues from
    the checkpoint of the step it stopped after and ends with the uninterrupted run's weights and held-out scores."""
    import pandas as pd

    out = tmp_path / "stopped"
    args = recipe_overrides(llama_folder, out, "trainer.devices=2", "train.checkpoint_every_n_steps=2",
                            "train.steps=40", "eval.lm_eval=null")
    port = free_port()
    log = tmp_path / "first.log"
    proc = start(torchrun(1, 2, port, f"stop-{port}", *args), tmp_path / "cwd", log)
    deadline = time.monotonic() + 600
    while not list(out.glob("runs/*/*/checkpoints/step-2.ckpt/meta.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    text = log.read_text()
    assert "SIGTERM received" in text and "done: " not in text, text[-3000:]
    (first,) = out.glob("runs/*/*/run.json")
    assert json.loads(first.read_text())["status"] == "stopped"
    again = finish([start(torchrun(1, 2, free_port(), f"again-{port}", *args), tmp_path / "cwd", tmp_path / "2.log")],
                   [tmp_path / "2.log"], 900)[0]
    assert "resume: continuing after step" in again and "done: " in again, again[-3000:]
    whole = tmp_path / "whole"
    text = finish([start(torchrun(1, 2, free_port(), f"whole-{port}", *recipe_overrides(
        llama_folder, whole, "trainer.devices=2", "train.checkpoint_every_n_steps=2", "train.steps=40",
        "eval.lm_eval=null")), tmp_path / "cwd", tmp_path / "3.log")], [tmp_path / "3.log"], 900)[0]
    assert "done: " in text, text[-3000:]
    resumed = max((p.parent for p in out.glob("runs/*/*/run.json")), key=lambda p: p.stat().st_mtime)
    (uninterrupted,) = [p.parent for p in whole.glob("runs/*/*/run.json")]
    a, b = weights(resumed / "model"), weights(uninterrupted / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert pd.read_csv(resumed / "tables" / "heldout_documents.csv").equals(
        pd.read_csv(uninterrupted / "tables" / "heldout_documents.csv"))


# -- every rank embeds on its own GPU --------------------------------------------------------------------------------
def test_every_rank_of_a_node_embeds_on_its_own_gpu(monkeypatch):
    """``embedder.device`` cuda or auto is the rank's own GPU in a launch (``LOCAL_RANK`` mod the GPUs it sees), and
    a plain process keeps ``cuda``; CUDA's presence is the one thing set here (this machine has none)."""
    from ccexp.embedding.shards import launch_device

    assert launch_device("auto") == "cpu" and launch_device("cpu") == "cpu"  # the real answer on this machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch_device("cuda") == "cuda" and launch_device("auto") == "cuda"
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    for local, expected in ((0, "cuda:0"), (3, "cuda:3"), (5, "cuda:1")):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert launch_device("cuda") == expected and launch_device("auto") == expected
    assert launch_device("cuda:2") == "cuda:2"  # an explicit device stays


# -- lm-eval: what would fail after training is one line before any stage --------------------------------------------
def test_lm_eval_that_cannot_be_imported_is_one_line_before_any_stage(tmp_path):
    broken = tmp_path / "site" / "lm_eval"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libsomething.so: cannot open shared object file')\n")
    proc = run_ccexp("debug=tiny", "eval=lm_eval", f"paths.outputs={tmp_path / 'out'}",
                     f"paths.cache={tmp_path / 'cache'}", cwd=tmp_path,
                     env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("ccexp: error: eval.lm_eval needs the lm-eval package, which cannot be imported here "
                                   "(ImportError: libsomething.so: cannot open shared object file); install it "
                                   "(scripts/setup.sh, or pip install 'lm-eval[hf]==0.4.13') or turn lm-eval off with "
                                   "eval.lm_eval=null")
    assert not (tmp_path / "cache").exists()  # no stage ran


def test_a_task_of_a_local_folder_runs_and_what_lm_eval_cannot_find_is_refused_before_any_work(llama_folder,
                                                                                                tmp_path):
    from omegaconf import OmegaConf

    from ccexp.data.tokenize import load_tokenizer
    from ccexp.evaluation.lm_eval_bridge import check_lm_eval, run_lm_eval
    from ccexp.training.models import hf_causal_lm

    folder = tmp_path / "my_tasks"
    folder.mkdir()
    (folder / "data.jsonl").write_text("".join(json.dumps({"text": f"the cat sat on the mat {i}"}) + "\n"
                                               for i in range(3)))
    (folder / "my_ppl.yaml").write_text(textwrap.dedent(f"""\
        task: my_ppl
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / 'data.jsonl'}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
        metadata:
          version: 1.0
        """))

    def lm(**kw):
        return OmegaConf.create({"tasks": [], "include_path": None, **kw})

    check_lm_eval(lm(tasks=["my_ppl"], include_path=str(folder)))
    with pytest.raises(CcexpError, match=r"'my_pll' is not an lm-eval task built in or in eval.lm_eval.include_path"):
        check_lm_eval(lm(tasks=["my_pll"], include_path=str(folder)))
    with pytest.raises(CcexpError, match=r"'my_ppl' is not an lm-eval task built in \(a task of your own: put its "
                                         r"folder in eval.lm_eval.include_path\)"):
        check_lm_eval(lm(tasks=["my_ppl"]))
    with pytest.raises(CcexpError, match=r"include_path='/nope' is not a folder"):
        check_lm_eval(lm(include_path="/nope"))
    with pytest.raises(CcexpError, match=r"'my_tasks/my_ppl.yaml' is a path; put the folder of its YAML in "
                                         r"eval.lm_eval.include_path"):
        check_lm_eval(lm(tasks=["my_tasks/my_ppl.yaml"]))
    with pytest.raises(CcexpError, match=r"'arc_easy' cannot be built offline \(.*\); put its dataset in the local "
                                         r"Hugging Face cache first"):
        check_lm_eval(lm(tasks=["arc_easy"]))  # a recipe's task, its dataset not in this test's empty HF cache
    model = hf_causal_lm(str(llama_folder))
    got = run_lm_eval(model, load_tokenizer(llama_folder), None, ["my_ppl"], batch_size=2, max_length=64,
                      include_path=str(folder))
    assert got["my_ppl/word_perplexity"] > 1


@pytest.mark.slow
def test_two_ranks_started_by_lightnings_own_launcher_train_and_score_the_recipe(llama_folder, tmp_path):
    """``trainer.devices=2`` without torchrun: Lightning starts the second process by running the command again (with
    ``LOCAL_RANK``, no ``RANK``); that rank follows rank 0 (it is no second run of the configuration, and never
    refused as one)."""
    out = tmp_path / "out"
    text = finish([start([sys.executable, "-m", "ccexp", *recipe_overrides(llama_folder, out, "trainer.devices=2",
                                                                          "eval.lm_eval=null")],
                         tmp_path / "cwd", tmp_path / "run.log")], [tmp_path / "run.log"], 600)[0]
    assert "done: " in text and "is running now" not in text, text[-3000:]
    folder, run = finished_run(out)
    assert run.info.status == "FINISHED" and len(list(out.glob("runs/*/*/run.json"))) == 1
