"""The memory plan against a measured run: ``python -m ccexp.plan model`` per phase beside what the run's own phase
marks measured (``<run>/timing.json``, ``memory_bytes``: :func:`ccexp.runtime.memory_bytes`).

The run is the headline command on the CPU, ``+recipe=llama2_7b`` under FSDP (gloo), on a Llama folder made here
with ``save_pretrained`` (hidden 512, 8 layers, 25 M parameters: its training states, 16 bytes a parameter, are
hundreds of MB, above the process's own noise), 1 rank (``python -m ccexp``) and 2 ranks (torchrun). On a GPU the
measured figure is the CUDA allocator's peak (what the plan counts, per GPU; ``benches/gpu_check.py`` check a). On
the CPU it is the resident set of rank 0's process: its rise during a phase (the phase's peak above the memory held
when it started) is compared with the plan's figure for that phase less what was already held (the model's shards
at the start of evaluation). The CPU figure also holds the allocator's caching, the corpus arrays and thread pools,
so the ratio says how far the plan's *shape* carries to a CPU run, not that it is a byte count. Printed as ratios,
never asserted.

Usage:
    python benches/bench_fsdp_memory.py                # 1 and 2 ranks
    python benches/bench_fsdp_memory.py --write        # and docs/measured/fsdp_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
STEPS = 4


def make_llama(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ccexp.data.tokenize import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["the cat sat on the mat", "define the word entity"] * 50, 300, out)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
                     ).save_pretrained(out)
    return out


def overrides(folder: Path, out: Path, ranks: int) -> list[str]:
    return ["+recipe=llama2_7b", "data=builtin", "data.max_documents=800", f"model.pretrained={folder}",
            "model.architecture=null", "trainer.accelerator=cpu", "trainer.precision=32-true", f"trainer.devices={ranks}",
            "trainer.threads=1", "clusterer.k=8", f"train.steps={STEPS}", "train.seq_len=128",
            "train.tokens_per_step=2048", "train.micro_batch_size=4", "train.warmup_steps=1", "eval.max_tokens=128",
            "eval.batch_size=8", "eval.every_n_steps=null", "eval.lm_eval.tasks=[]", "eval.lm_eval.batch_size=4",
            "eval.lm_eval.max_docs_per_task=8", "eval.lm_eval.mc_docs=8", "logger=none", f"paths.outputs={out}",
            f"paths.cache={out / 'cache'}"]  # its own: each run embeds


def run(folder: Path, out: Path, ranks: int) -> dict:
    """The run's ``timing.json`` (rank 0's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")}
    args = overrides(folder, out, ranks)
    if ranks == 1:
        cmd = [sys.executable, "-m", "ccexp", *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={port}",
               "-m", "ccexp", *args]
    proc = subprocess.run(cmd, cwd=out.parent, env={**env, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"bench_fsdp_memory: the {ranks}-rank run failed:\n{proc.stderr[-3000:]}")
    (timing,) = out.glob("runs/*/*/timing.json")
    return json.loads(timing.read_text())


def plan(folder: Path, out: Path, ranks: int) -> dict:
    from ccexp.config import compose
    from ccexp.plan import build_meta_model, estimate

    cfg = compose(overrides(folder, out, ranks))
    model, config = build_meta_model(cfg)
    return estimate(cfg, model, config, 1e6)


def compare(timing: dict, e: dict) -> list[dict]:
    """Per phase: planned GiB, measured start and peak GiB, the rise, and the rise over the plan's new bytes."""
    held_after_training = e["weights_gib"] + e["gradients_gib"] + e["optimizer_gib"]
    pairs = {"embedding": ("embed", 0.0), "training": ("train", 0.0), "evaluation": ("eval", held_after_training),
             "lm-eval": ("lm_eval", 0.0)}
    rows = []
    for phase, (mark, resident) in pairs.items():
        m = timing["memory_bytes"].get(mark)
        if m is None:
            continue
        planned = e["phases_gib"][phase]
        rise = (m["peak"] - m["start"]) / GIB
        rows.append({"phase": phase, "planned_gib": planned, "planned_new_gib": planned - resident,
                     "start_gib": m["start"] / GIB, "peak_gib": m["peak"] / GIB, "rise_gib": rise,
                     "ratio": rise / max(planned - resident, 1e-9)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="write docs/measured/fsdp_memory.json")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="ccexp-bench-fsdp-") as tmp:
        folder = make_llama(Path(tmp) / "llama")
        for ranks in (1, 2):
            out = Path(tmp) / f"out{ranks}"
            timing = run(folder, out, ranks)
            e = plan(folder, out, ranks)
            rows = compare(timing, e)
            results[ranks] = {"memory_kind": timing["memory_kind"], "parameters": e["parameters"], "phases": rows}
            print(f"\n{ranks} rank(s), {e['parameters'] / 1e6:.1f} M parameters, measured as {timing['memory_kind']} "
                  "of rank 0")
            print(f"  {'phase':<11} {'plan GiB':>9} {'plan new':>9} {'start':>7} {'peak':>7} {'rise':>7} {'rise/new':>9}")
            for r in rows:
                print(f"  {r['phase']:<11} {r['planned_gib']:9.3f} {r['planned_new_gib']:9.3f} {r['start_gib']:7.3f} "
                      f"{r['peak_gib']:7.3f} {r['rise_gib']:7.3f} {r['ratio']:9.2f}")
    if args.write:
        path = ROOT / "docs" / "measured" / "fsdp_memory.json"
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
