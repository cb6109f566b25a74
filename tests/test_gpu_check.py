"""benches/gpu_check.py, the prepared GPU check (issue 24): on a machine without a GPU it says so in its
first line, writes {"gpu": null, "ran": false} and exits 2; --dry-run lists the five checks anywhere;
the ~1B architecture of check a really has ~1B parameters; every ccexp command the checks run composes
and passes the schemas' key checks, and check a's memory plan runs. The tests that need a GPU are skipped here (@requires_gpu)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from warm import python_m
from helpers import requires_gpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benches" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str, out: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_without_a_gpu_it_says_so_first_writes_the_json_and_exits_2(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this runs the no-GPU path on every machine
    proc = run_script("--work", str(tmp_path / "work"), out=tmp_path, env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("gpu_check: no NVIDIA GPU visible (") and first.endswith("; nothing measured"), first
    assert "Traceback" not in proc.stdout + proc.stderr
    assert all(f"  {c}. " in proc.stdout for c in "abcdef")  # what it would run
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["gpu"] is None and summary["ran"] is False and summary["reason"] in first
    assert not (tmp_path / "work").exists()  # nothing set up


def test_dry_run_lists_all_six_checks_with_their_commands(tmp_path):
    proc = run_script("--dry-run", "--work", str(tmp_path / "w"), out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpu_check: dry run: the plan of 6 check(s) (a,b,c,d,e,f)")
    for c in "abcdef":
        assert any(line.startswith(f"  {c}. ") for line in lines), c
    text = proc.stdout
    assert "python -m ccexp +recipe=llama2_7b" in text and "trainer.devices=1" in text
    assert "train.resume_from=" in text and "step-10.ckpt" in text and "python -m ccexp.plan model" in text
    assert "+recipe=smollm2_135m trainer=gpu" in text and "trainer=ddp trainer.devices=2" in text
    assert "FaissKMeans(k=10000" in text and "TwoLevelKMeans(k=10000" in text and "SentenceEmbedder(" in text
    assert not (tmp_path / "gpu_check.json").exists() and not (tmp_path / "w").exists()
    only = run_script("--dry-run", "--only", "c,d", out=tmp_path)
    assert only.returncode == 0 and "  c. " in only.stdout and "  a. " not in only.stdout
    bad = run_script("--only", "a,z", out=tmp_path)
    assert bad.returncode == 2 and "--only" in bad.stderr and "Traceback" not in bad.stderr


def test_the_one_billion_architecture_has_about_one_billion_parameters():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    g = gpu_check()
    arch = g.one_b_architecture()
    recipe = g.recipe_architecture("llama2_7b")
    assert {k: v for k, v in arch.items() if k != "num_hidden_layers"} == \
        {k: v for k, v in recipe.items() if k != "num_hidden_layers"}  # the recipe's numbers, fewer layers
    assert arch["num_hidden_layers"] == 4 < recipe["num_hidden_layers"]
    numbers = dict(arch)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(numbers.pop("model_type"), **numbers))
    n = sum(p.numel() for p in model.parameters())
    assert 0.9e9 <= n <= 1.2e9, n
    assert n == g.llama_parameters(arch, arch["num_hidden_layers"])
    assert g.llama_parameters(recipe, 32) == pytest.approx(6.74e9, rel=0.01)  # Llama-2-7B itself


def test_the_memory_plan_of_check_a_composes_and_counts_the_same_model(tmp_path, capsys):
    """Check a's ``python -m ccexp.plan model`` command, on this machine: its folder does not exist yet,
    so the plan builds the model from the recipe's numbers at the reduced depth."""
    from ccexp import plan

    g = gpu_check()
    cmd = g.plan_a(tmp_path)["commands"]["plan"]
    args = [("141" if a == "<this GPU's GB>" else a) for a in cmd[cmd.index("model"):]]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "1.07 B" in out and "bf16-mixed" in out and "activation ckpt     on" in out


def test_every_ccexp_command_of_the_checks_composes_and_passes_the_key_checks(tmp_path):
    """A misspelt override would fail on the GPU machine, minutes in: compose each one here."""
    from ccexp import config, preflight

    g = gpu_check()
    commands = [cmd for c in g.CHECKS for cmd in g.PLANS[c](tmp_path).get("commands", {}).values()]
    commands = [one for cmd in commands for one in (cmd if isinstance(cmd[0], list) else [cmd])]
    assert len(commands) == 6 + len(g.PACK_N)  # check f: one packed sweep per N
    for cmd in commands:
        overrides = cmd[cmd.index("--") + 1:] if "--_probe" in cmd else cmd[cmd.index("ccexp") + 1:] \
            if "ccexp" in cmd else cmd[cmd.index("--gpu-gb") + 2:]
        overrides = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "-m"))]  # a sweep: its first job
        overrides = [o.split(",")[0] if o.startswith("seed=") else o for o in overrides]
        cfg = config.compose(overrides)
        preflight._check_keys_and_bounds(cfg, config.RootConfig, "")


def test_peak_table_and_steady_rate():
    g = gpu_check()
    assert g.peak_tflops("NVIDIA H100 80GB HBM3") == 989 and g.peak_tflops("NVIDIA H200") == 989
    assert g.peak_tflops("NVIDIA A100-SXM4-80GB") == 312 and g.peak_tflops("NVIDIA H100 PCIe") == 756
    assert g.peak_tflops("Tesla T4") is None
    log = "\n".join(f"[x][ccexp][INFO] - train: step {s}/20 ({5 * s}%), {1000 * s:,} tokens, loss 9.1234, "
                    f"{1000 * s // (s + 1):,} tokens/s, ETA 1s" for s in range(1, 21))
    rows = g.steps_of(log)
    assert [r["step"] for r in rows] == list(range(1, 21)) and rows[0]["loss"] == "9.1234"
    assert g.steady_rate(rows, 12) == pytest.approx(1000, rel=0.01)  # 1 s per step after the first


# ------------------------------------------------------------------------------------- needs a GPU
@requires_gpu
def test_gpu_fsdp_two_steps_write_a_sharded_checkpoint_and_resume(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama_tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512)).save_pretrained(folder)
    common = ["+recipe=llama2_7b", "data=builtin", "data.max_documents=600", "eval=default", "eval.every_n_steps=null",
              "logger=none", "trainer.devices=1", f"model.pretrained={folder}", "model.architecture=null",
              "model.tokenizer.kind=bpe", "model.tokenizer.vocab_size=2048", "clusterer.k=8", "train.steps=2",
              "train.seq_len=256", "eval.max_tokens=256", "train.micro_batch_size=2", "train.tokens_per_step=1024", "train.warmup_steps=1",
              "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=1", f"paths.cache={tmp_path / 'cache'}",
              f"paths.outputs={tmp_path / 'out'}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    full = python_m("ccexp", *common, f"hydra.run.dir={tmp_path / 'full'}", cwd=ROOT, env=env, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    ckpt = tmp_path / "full" / "checkpoints" / "step-1.ckpt"
    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file()  # sharded: a folder
    resumed = python_m("ccexp", *common, f"hydra.run.dir={tmp_path / 'resumed'}", f"train.resume_from={ckpt}",
                       cwd=ROOT, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    g = gpu_check()
    a, b = (g.steps_of(p.stdout + p.stderr) for p in (full, resumed))
    assert [r["loss"] for r in a if r["step"] == 2] == [r["loss"] for r in b if r["step"] == 2]


@requires_gpu
def test_gpu_faiss_kmeans_small_matches_the_cpu():
    from ccexp.clustering.kmeans import FaissKMeans, use_gpu

    assert use_gpu("auto"), "faiss has no GPU: scripts/setup.sh installs faiss-gpu-cu12 where nvidia-smi works"
    x = np.random.default_rng(0).standard_normal((20_000, 64), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    mask = np.ones(len(x), bool)
    gpu = FaissKMeans(k=100, niter=10, device="gpu").fit(x, mask)
    cpu = FaissKMeans(k=100, niter=10, device="cpu").fit(x, mask)
    assert gpu.similarity.mean() == pytest.approx(cpu.similarity.mean(), rel=0.01)


@requires_gpu
def test_gpu_minilm_embeds_on_cuda_like_the_cpu():
    from ccexp.embedding.sentence import SentenceEmbedder

    texts = [f"document {i} about clusters and sampling" for i in range(64)]
    a, _ = SentenceEmbedder(device="cuda").encode(texts)
    b, _ = SentenceEmbedder(device="cpu").encode(texts)
    assert np.abs(a - b).max() < 1e-3


@requires_gpu
def test_gpu_plain_loop_runs():
    from ccexp.training.models import tiny_gpt

    g = gpu_check()
    assert g.plain_loop(tiny_gpt(vocab_size=512, eos_id=0), rows=4, seq=64, accumulation=2, vocab=512, steps=3,
                        warmup=1) > 0
