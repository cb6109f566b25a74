"""Will it fit? A dry run that builds the configured model on the meta device (no weights, no
download) and prints its parameters and the per-GPU memory of weights, gradients, optimizer state
and activations under the chosen trainer strategy, precision and micro-batch.

    python -m ccexp.plan model +recipe=llama2_7b [--gpu-gb 80] [key=value ...]

The architecture comes from ``model.pretrained``'s ``config.json`` when that is a local folder or
cached, else from ``model.architecture`` (the same numbers, carried by the recipe: no download).

Estimates (bytes; P parameters, W ranks, m micro-batch rows, s = seq_len, h hidden, L layers, V vocab):
* weights / gradients / AdamW state: 2 / 2 / 4 bytes per parameter with ``bf16-true`` (the
  optimizer state in bf16, as Lightning's true-precision plugins keep it), 4 / 4 / 8 otherwise (fp32
  master weights; ``*-mixed`` adds no persistent copy). FULL_SHARD divides all three by W and adds
  two gathered decoder layers (the one computing and the one prefetched); SHARD_GRAD_OP divides
  gradients and optimizer state only; DDP and single devices keep everything.
* activations: with activation checkpointing, each layer's input ``m·s·h`` (16-bit) for every layer
  plus one layer's internals recomputed in backward, ``34·m·s·h`` bytes (Korthikanti et al. 2022,
  "Reducing Activation Recomputation", eq. 1 without the attention-score term, which SDPA/flash
  attention does not store); without it, ``34·m·s·h`` per layer. Plus the logits and their gradient
  in fp32, ``2 · 4·m·s·V``.
These are lower bounds: the CUDA context (~0.5-1 GB), allocator fragmentation and communication
buffers come on top, so the plan asks for 10 % headroom.
"""
from __future__ import annotations

import argparse
import sys

from ccexp.errors import CcexpError

GIB = 2**30


def build_meta_model(cfg):
    """The configured model on the meta device (no memory, no download) and its HF config.

    Raises:
        CcexpError: if neither a local ``model.pretrained`` nor ``model.architecture`` gives the architecture.
    """
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoModelForCausalLM

    m = cfg.model
    arch = OmegaConf.select(cfg, "model.architecture")
    config = None
    if "pretrained" in m:  # a local folder or cached id: its own config.json wins over the recipe's numbers
        from ccexp.training.pretrained import is_gguf, resolve_pretrained

        source = resolve_pretrained(m.pretrained)
        if not is_gguf(source):
            try:
                config = AutoConfig.from_pretrained(source, local_files_only=True)
            except (OSError, ValueError):
                if not arch:
                    raise CcexpError(f"model.pretrained={m.pretrained!r} is not available locally and the config has "
                                     "no model.architecture; add the numbers of its config.json as model.architecture"
                                     ) from None
        elif not arch:
            raise CcexpError("ccexp.plan reads a GGUF model's architecture from model.architecture; add it")
    if config is None and arch:
        arch = OmegaConf.to_container(arch, resolve=True)
        config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    elif config is None:  # tiny_gpt: built from its own settings
        from transformers import GPT2Config

        config = GPT2Config(vocab_size=m.tokenizer.vocab_size, n_positions=m.n_positions, n_embd=m.n_embd,
                            n_layer=m.n_layer, n_head=m.n_head, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, config


def estimate(cfg, model, config, gpu_gb: float) -> dict:
    """Per-GPU memory figures in GiB (see the module docstring) and whether they fit ``gpu_gb``."""
    from ccexp.config import world_size

    params = sum(p.numel() for p in model.parameters())
    world = world_size(cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.accelerator)
    precision = str(cfg.trainer.precision)
    w_b, g_b, o_b = (2, 2, 4) if precision in ("bf16-true", "16-true") else (4, 4, 8)
    strategy = str(cfg.trainer.strategy)
    fsdp = strategy.startswith("fsdp")
    shard = cfg.trainer.fsdp.sharding_strategy if fsdp else None
    h = int(getattr(config, "hidden_size", getattr(config, "n_embd", 0)))
    layers = int(getattr(config, "num_hidden_layers", getattr(config, "n_layer", 1)))
    vocab = int(config.vocab_size)
    layer_params = max(0, params - 2 * vocab * h) / max(layers, 1)
    if shard in ("FULL_SHARD", "HYBRID_SHARD") and world > 1:
        weights = params * w_b / world + 2 * layer_params * w_b  # + the gathered layer and the prefetched one
        grads, optim = params * g_b / world, params * o_b / world
    elif shard == "SHARD_GRAD_OP":
        weights, grads, optim = params * w_b, params * g_b / world, params * o_b / world
    else:
        weights, grads, optim = params * w_b, params * g_b, params * o_b
    m, s = int(cfg.train.micro_batch_size), int(cfg.train.seq_len)
    checkpointing = bool(cfg.trainer.fsdp.activation_checkpointing if fsdp else
                         cfg.model.get("gradient_checkpointing", False))
    sbh = m * s * h
    acts = (layers * sbh * 2 + 34 * sbh) if checkpointing else layers * 34 * sbh
    logits = 2 * 4 * m * s * vocab
    total = weights + grads + optim + acts + logits
    return {"parameters": params, "world_size": world, "strategy": strategy + (f" {shard}" if shard else ""),
            "precision": precision, "micro_batch": m, "seq_len": s, "activation_checkpointing": checkpointing,
            "weights_gib": weights / GIB, "gradients_gib": grads / GIB, "optimizer_gib": optim / GIB,
            "activations_gib": acts / GIB, "logits_gib": logits / GIB, "total_gib": total / GIB,
            "gpu_gib": gpu_gb * 1e9 / GIB, "fits": total * 1.1 <= gpu_gb * 1e9,
            "grad_accumulation": int(cfg.train.grad_accumulation), "tokens_per_step": int(cfg.train.tokens_per_step)}


def render(cfg, e: dict) -> str:
    name = cfg.recipe_name or cfg.model.name
    lines = [f"ccexp plan: {name} ({cfg.model.get('pretrained', cfg.model.name)})",
             f"  parameters          " + (f"{e['parameters'] / 1e9:.2f} B" if e["parameters"] >= 1e9 else
                                         f"{e['parameters'] / 1e6:.1f} M") + f" ({e['parameters']:,})",
             f"  ranks               {e['world_size']} ({cfg.trainer.devices} device(s) x {cfg.trainer.num_nodes} node(s)), "
             f"{e['strategy']}, {e['precision']}",
             f"  step                {e['tokens_per_step']:,} tokens = {e['world_size']} ranks x {e['grad_accumulation']} "
             f"micro-batches x {e['micro_batch']} rows x {e['seq_len']} tokens",
             f"  activation ckpt     {'on' if e['activation_checkpointing'] else 'off'}",
             "  per-GPU memory (GiB)",
             f"    weights           {e['weights_gib']:8.2f}",
             f"    gradients         {e['gradients_gib']:8.2f}",
             f"    optimizer (AdamW) {e['optimizer_gib']:8.2f}",
             f"    activations       {e['activations_gib']:8.2f}",
             f"    logits (fp32)     {e['logits_gib']:8.2f}",
             f"    total             {e['total_gib']:8.2f}  of {e['gpu_gib']:.1f} GiB per GPU "
             f"({e['total_gib'] / e['gpu_gib']:.0%})",
             "  verdict             " + ("fits (with 10 % headroom for the CUDA context and fragmentation)" if e["fits"]
                                         else "does NOT fit: " + "; ".join(advice(cfg, e)))]
    return "\n".join(lines)


def advice(cfg, e: dict) -> list[str]:
    """What would shrink the largest parts, naming only settings not already in use."""
    out = []
    fsdp = str(cfg.trainer.strategy).startswith("fsdp")
    states = e["weights_gib"] + e["gradients_gib"] + e["optimizer_gib"]
    if states > e["activations_gib"] + e["logits_gib"]:
        if not fsdp or cfg.trainer.fsdp.sharding_strategy != "FULL_SHARD":
            out.append("shard weights, gradients and optimizer state (trainer=fsdp, "
                       "trainer.fsdp.sharding_strategy=FULL_SHARD)")
        out.append(f"more GPUs (weights, gradients and optimizer state are {states:.1f} GiB here and divide by the "
                   "number of ranks)")
        if fsdp and not cfg.trainer.fsdp.cpu_offload:
            out.append("trainer.fsdp.cpu_offload=true (parameters and gradients in host memory; slower)")
    else:
        if e["micro_batch"] > 1:
            out.append(f"a smaller train.micro_batch_size (now {e['micro_batch']}; the step's tokens stay the same)")
        if not e["activation_checkpointing"]:
            out.append("activation checkpointing (trainer.fsdp.activation_checkpointing=true or "
                       "model.gradient_checkpointing=true)")
        out.append("a shorter train.seq_len")
    return out


USAGE = "usage: python -m ccexp.plan model [--gpu-gb 80] [overrides ...]   (parameters and memory per GPU)"


def main(argv: list[str] | None = None) -> int:
    """Print the plan; exit 0 when it fits, 1 when it does not, 2 for bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "model":
        print(USAGE, file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="python -m ccexp.plan model",
                                 description="Will it fit? Build the configured model on the meta device (no "
                                             "weights, no download) and print its parameters and per-GPU memory.")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="memory of one GPU in GB (default 80: A100/H100 80GB)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m ccexp (e.g. +recipe=llama2_7b)")
    args = ap.parse_intermixed_args(argv[1:])
    if not 0 < args.gpu_gb < float("inf"):
        ap.error(f"--gpu-gb={args.gpu_gb} must be a number of GB > 0")
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ccexp.__main__ import CONFIG_DIR

    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
            cfg = compose("config", overrides=args.overrides)
        from ccexp.preflight import check_fsdp_options

        check_fsdp_options(cfg.trainer)
        model, config = build_meta_model(cfg)
        e = estimate(cfg, model, config, args.gpu_gb)
    except CcexpError as err:
        print(f"ccexp: error: {err}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as err:
        from ccexp.__main__ import one_line

        cause = err.__cause__ or err.__context__
        print("ccexp: error: " + (str(cause) if isinstance(cause, CcexpError) else one_line(err)), file=sys.stderr)
        return 2
    print(render(cfg, e))
    return 0 if e["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
