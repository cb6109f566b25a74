"""Plans that cost no training run.

``python -m ccexp.plan [overrides]`` — the stream plan: the configured policy's exact token stream
for ``train.steps`` steps of ``train.tokens_per_step`` tokens, without a model, over this config's
own cached stages (``plan.source=corpus``) or a synthetic corpus (``plan.source=synthetic``:
``plan.clusters``, ``plan.documents``, Zipf sizes, log-normal lengths). It reports per cluster the
documents and tokens drawn and the step a clip took it out, the repetition histogram, and the mix's
entropy and KL over time: ``plan.md``, ``clusters.csv``, ``history.csv``, ``plan.png`` under
``<paths.outputs>/plans/``, and an MLflow run (experiment ``<logger.experiment>-plan``, tag
``ccexp.plan``). A comma list sweeps (``sampler.clip_threshold=2,3,5,10``): one plan each, drawn on
one plot.

``python -m ccexp.plan model`` — will it fit? A dry run that builds the configured model on the
meta device (no weights, no download) and prints its parameters and the per-GPU memory of weights,
gradients, optimizer state and activations under the chosen trainer strategy, precision and
micro-batch, then the peak of every phase of a run (embedding, training, held-out evaluation, lm-eval:
[`phase_peaks`][ccexp.plan.phase_peaks]); it fits when the largest does.

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
import logging
import sys

from ccexp.errors import CcexpError

GIB = 2**30


def build_meta_model(cfg):
    """The configured model on the meta device (no memory, no download) and its HF config.

    Raises:
        CcexpError: if neither a local ``model.pretrained`` nor ``model.architecture`` gives the architecture.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ccexp.config import component

    m = cfg.model
    declared = component("model", m)
    arch, pretrained = declared.architecture_numbers(m), declared.weights_source(m)
    config = None
    if pretrained is not None:  # a local folder or cached id: its own config.json wins over the recipe's numbers
        from ccexp.model_source import is_gguf, resolve_pretrained

        source = resolve_pretrained(pretrained)
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
        arch = dict(arch)
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
    phases = phase_peaks(cfg, config, params, world, weights, grads, optim, total)
    return {"phases_gib": {k: v / GIB for k, v in phases.items()}, "parameters": params, "world_size": world,
            "strategy": strategy + (f" {shard}" if shard else ""),
            "precision": precision, "micro_batch": m, "seq_len": s, "activation_checkpointing": checkpointing,
            "weights_gib": weights / GIB, "gradients_gib": grads / GIB, "optimizer_gib": optim / GIB,
            "activations_gib": acts / GIB, "logits_gib": logits / GIB, "total_gib": total / GIB,
            "gpu_gib": gpu_gb * 1e9 / GIB, "fits": max(phases.values()) * 1.1 <= gpu_gb * 1e9,
            "grad_accumulation": int(cfg.train.grad_accumulation), "tokens_per_step": int(cfg.train.tokens_per_step)}


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# tokens of lm-eval's longest request the plan assumes: the local tasks' documents are cut at 1,500 characters
# (ccexp.evaluation.lm_eval_bridge), and a standard task's few-shot prompt (MMLU 5-shot, GSM8K 8-shot) is shorter
LM_EVAL_WINDOW = 2048


def _embedder_bytes(cfg, config, params: int) -> float:
    """The embedding phase on one device: the embedder's weights and one batch's forward (no gradient kept): its
    hidden states ``b·s·h`` in a few copies and, for the gradient proxy (the run's causal LM), its fp32 logits."""
    from ccexp.config import component

    emb = cfg.embedder
    b, s = int(emb.batch_size), int(emb.max_seq_length)
    dtype = str(emb.get("dtype", "float32"))
    width = DTYPE_BYTES.get(dtype, 2 if dtype == "auto" else 4)
    if component("embedder", emb).uses_run_model(emb):  # CluSTER's proxy: the run's model, whole, on each rank
        h = int(getattr(config, "hidden_size", getattr(config, "n_embd", 0)))
        return params * width + 8 * b * s * h * width + 2 * 4 * b * s * int(config.vocab_size)
    try:  # a sentence-transformers folder: its own config.json, built on the meta device
        import torch
        from transformers import AutoConfig, AutoModel

        from ccexp.embedding.sentence import resolve_model_path

        econf = AutoConfig.from_pretrained(resolve_model_path(str(emb.model)), local_files_only=True)
        with torch.device("meta"):
            eparams = sum(p.numel() for p in AutoModel.from_config(econf).parameters())
        h = int(getattr(econf, "hidden_size", 384))
    except Exception:  # a folder only a real run can read: MiniLM's size, the packaged default
        eparams, h = 22_700_000, 384
    return eparams * 4 + 16 * b * s * h * width


def phase_peaks(cfg, config, params: int, world: int, weights: float, grads: float, optim: float,
                training: float) -> dict[str, float]:
    """Bytes per device at the peak of each phase of a run, in the order they happen:

    * ``embedding``: [`_embedder_bytes`][ccexp.plan._embedder_bytes] (before the model is built);
    * ``training``: the states and activations of the module docstring;
    * ``evaluation``: held-out scoring with the trained model as it is (sharded under FSDP, the training states still
      held): one no-grad forward of ``eval.batch_size`` rows of ``eval.max_tokens`` tokens, its logits in the compute
      dtype plus their fp32 copy and the cross-entropy's (``3 · 4·b·s·V``), hidden states ``8·b·s·h``;
    * ``lm-eval``: under FSDP the optimizer state and gradients are freed, the weight shards stay, and the exported
      model is loaded whole on rank 0 in the compute dtype (bf16 for ``bf16-*``), one batch of
      ``eval.lm_eval.batch_size`` windows scored (fp32 log-softmax), a window the model's context or
      [`LM_EVAL_WINDOW`][ccexp.plan.LM_EVAL_WINDOW] tokens, whichever is shorter (lm-eval pads a batch to its longest
      request); elsewhere the trained model itself, the training states freed by Lightning's teardown. 0 when
      ``eval.lm_eval`` is off.
    """
    h = int(getattr(config, "hidden_size", getattr(config, "n_embd", 0)))
    vocab = int(config.vocab_size)
    fsdp = str(cfg.trainer.strategy).startswith("fsdp")
    compute = 2 if "16" in str(cfg.trainer.precision) else 4
    b, s = int(cfg.eval.batch_size), int(cfg.eval.max_tokens)
    evaluation = weights + grads + optim + 8 * b * s * h * compute + 3 * 4 * b * s * vocab
    out = {"embedding": _embedder_bytes(cfg, config, params), "training": training, "evaluation": evaluation,
           "lm-eval": 0.0}
    lm = cfg.eval.lm_eval
    if lm is not None:
        context = min(LM_EVAL_WINDOW, int(getattr(config, "max_position_embeddings", getattr(config, "n_positions",
                                                                                               LM_EVAL_WINDOW))))
        lb = int(lm.batch_size)
        whole = params * compute + (weights if fsdp and world > 1 else 0)
        out["lm-eval"] = whole + 8 * lb * context * h * compute + 2 * 4 * lb * context * vocab
    return out


def render(cfg, e: dict) -> str:
    name = cfg.recipe_name or cfg.model.name
    lines = [f"ccexp plan: {name} ({cfg.model.get('pretrained', cfg.model.name)})",
             "  parameters          " + (f"{e['parameters'] / 1e9:.2f} B" if e["parameters"] >= 1e9 else
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
             "  peak per phase (GiB per GPU)",
             *(f"    {phase:<12}      {gib:8.2f}" + ("" if gib else "  (eval.lm_eval off)" if phase == "lm-eval" else "")
               for phase, gib in e["phases_gib"].items()),
             "  verdict             " + ("fits (with 10 % headroom for the CUDA context and fragmentation)" if e["fits"]
                                         else "does NOT fit: " + "; ".join(advice(cfg, e)))]
    return "\n".join(lines)


def advice(cfg, e: dict) -> list[str]:
    """What would shrink the largest parts, naming only settings not already in use: training's own first, then
    those of each other phase that needs more than the GPU holds."""
    budget = e["gpu_gib"] / 1.1
    out = training_advice(cfg, e) if e["total_gib"] > budget else []
    phases = e.get("phases_gib", {})

    def needs(phase: str) -> str:
        return (f"{phases[phase]:.1f} GiB ({1.1 * phases[phase]:.1f} with the 10 % headroom, of {e['gpu_gib']:.1f} "
                "per GPU)")

    if phases.get("evaluation", 0) > budget and not out:  # it holds training's states: first make training fit
        out.append(f"held-out scoring needs {needs('evaluation')}: a smaller eval.batch_size (now "
                   f"{cfg.eval.batch_size}) or eval.max_tokens (now {cfg.eval.max_tokens})")
    if phases.get("lm-eval", 0) > budget:
        out.append(f"lm-eval needs {needs('lm-eval')} on rank 0 (the trained model whole): a smaller "
                   f"eval.lm_eval.batch_size (now {cfg.eval.lm_eval.batch_size}), or eval.lm_eval=null and lm-eval "
                   "later on <run>/model (train.save_model=true) on a larger GPU")
    if phases.get("embedding", 0) > budget:
        out.append(f"embedding needs {needs('embedding')}: a smaller embedder.batch_size (now "
                   f"{cfg.embedder.batch_size})")
    return out


def training_advice(cfg, e: dict) -> list[str]:
    """What would shrink training's largest parts."""
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


USAGE = ("usage: python -m ccexp.plan [overrides ...]                      (the policy's token stream, no model)\n"
         "       python -m ccexp.plan model [--gpu-gb 80] [overrides ...]   (parameters and memory per GPU)")


def main(argv: list[str] | None = None) -> int:
    """``model``: print the memory plan, exit 0 when it fits, 1 when it does not; else the stream
    plan ([`stream_main`][ccexp.plan.stream_main]). Bad input exits 2 with one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):  # before or after overrides: never read as an override
        return print_help(argv)
    if not argv or argv[0] != "model":
        if "--gpu-gb" in argv:
            print("ccexp: error: --gpu-gb is an option of the memory plan: python -m ccexp.plan model --gpu-gb 80 "
                  "[overrides]", file=sys.stderr)
            return 2
        return stream_main(argv)
    ap = argparse.ArgumentParser(prog="python -m ccexp.plan model",
                                 description="Will it fit? Build the configured model on the meta device (no "
                                             "weights, no download) and print its parameters and per-GPU memory.")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="memory of one GPU in GB (default 80: A100/H100 80GB)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m ccexp (e.g. +recipe=llama2_7b)")
    args = ap.parse_intermixed_args(argv[1:])
    if not 0 < args.gpu_gb < float("inf"):
        ap.error(f"--gpu-gb={args.gpu_gb} must be a number of GB > 0")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ccexp.config import compose

    try:
        cfg = compose(args.overrides)
        from ccexp.preflight import check_devices, check_fsdp_options

        check_devices(cfg.trainer)  # before the world size divides anything
        check_fsdp_options(cfg.trainer)
        model, config = build_meta_model(cfg)
        e = estimate(cfg, model, config, args.gpu_gb)
    except (CcexpError, HydraException, OmegaConfBaseException) as err:
        return error_line(err)
    print(render(cfg, e))
    return 0 if e["fits"] else 1


def print_help(argv: list[str]) -> int:
    """``--help``: the usage, then the settings a plan reads (the stream plan: plan, data, clusterer,
    sampler, train; ``model``: model, trainer, train) with their values under the overrides given and
    what each does; ``model --help`` first lists its own options. Exit status 0, or 2 with one line for
    an override that does not compose."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ccexp.help import help_text, plain

    model = bool(argv) and argv[0] == "model"
    given = argv[1:] if model else argv
    overrides = [a for i, a in enumerate(given) if not a.startswith("-") and (i == 0 or given[i - 1] != "--gpu-gb")]
    header = (plain(__doc__.split("\n\n")[0]) + "\n" + USAGE + "\n\n" +
              ("options of `model`:\n  --gpu-gb GB   memory of one GPU in GB (default 80: A100/H100 80GB)\n\n" if model
               else "") + "Overrides are python -m ccexp's (group=option, key=value; a comma list sweeps).")
    try:
        shown = expand_sweep(overrides)[0]
        print(help_text(shown, swept=shown != overrides, header=header,
                        sections=("model", "trainer", "train") if model else ("plan", "data", "clusterer", "sampler",
                                                                               "train"),
                        footer="Every setting of a run: python -m ccexp --help. Outputs: <paths.outputs>/plans/."))
    except (CcexpError, HydraException, OmegaConfBaseException) as err:
        return error_line(err)
    return 0


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """The Cartesian product of comma-list overrides (Hydra's override grammar), one list per plan or
    sweep job, as Hydra's basic sweeper expands them: a key given twice keeps its first place and its
    last value, and the first key varies slowest."""
    import itertools

    from ccexp.preflight import sweep_choices

    return [list(c) for c in itertools.product(*sweep_choices(overrides).values())]


def stream_main(overrides: list[str]) -> int:
    """The stream plan of every combination of ``overrides``; see the module docstring."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ccexp.config import compose
    from ccexp.runtime import quiet_libraries

    quiet_libraries()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    once = SaidOnce()
    try:
        variants = expand_sweep(overrides)
        from pathlib import Path

        from ccexp.preflight import check_sweep_values

        check_sweep_values(overrides)  # every value of every list is an option, before any stage

        from ccexp.tracking.mlflow_run import check_store

        first = compose(variants[0])  # the plan's runs go where a run's would: the store said, a server asked, first
        check_store(first.logger, Path(first.paths.outputs).expanduser().resolve())
        plans, impossible = [], []
        logging.getLogger("ccexp").addFilter(once)  # the stages' lines and warnings once, not per variant
        for variant in variants:  # a variant the data cannot supply is marked; the others are planned
            cfg = compose(variant)
            try:
                plans.append((label_of(variant, overrides), cfg, stream_plan(cfg)))
            except CcexpError as err:
                if len(variants) == 1:
                    raise
                impossible.append((label_of(variant, overrides), str(err)))
                logging.getLogger("ccexp").warning("plan: %s cannot run: %s", impossible[-1][0], err)
        if not plans:
            raise CcexpError("no variant can run: " + " | ".join(f"{label}: {why}" for label, why in impossible))
        out = write_plans(plans, impossible)
    except (CcexpError, HydraException, OmegaConfBaseException) as err:
        return error_line(err)
    finally:
        logging.getLogger("ccexp").removeFilter(once)
    print(f"plan: {out / 'plan.md'}" + (f" ({len(impossible)} of {len(variants)} variants cannot run: see it)"
                                       if impossible else ""))
    return 0


class SaidOnce(logging.Filter):
    """Each log message once: variants that share a corpus read the same stages from the cache and would repeat
    their lines and warnings (the corpus, its labels, each stage's line again with ``reused=True``) once per
    variant. A stage's line is the same line whether computed or reused (its fingerprint names it)."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[tuple[int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        import re

        key = (record.levelno, re.sub(r"reused=\w+, [\d.]+ s", "", record.getMessage()))
        if key in self.said:
            return False
        self.said.add(key)
        return True


def error_line(err: BaseException) -> int:
    """Print bad input as the one ``ccexp: error:`` line (a CcexpError behind a Hydra error is shown
    as itself) and return exit status 2."""
    from ccexp.errors import one_line

    cause = err if isinstance(err, CcexpError) else err.__cause__ or err.__context__
    print("ccexp: error: " + (str(cause) if isinstance(cause, CcexpError) else one_line(err)), file=sys.stderr)
    return 2


def label_of(variant: list[str], overrides: list[str]) -> str:
    """The part of a variant that the sweep varies (or the sampler's name for a single plan)."""
    varied = [v for v in variant if v not in overrides]
    return " ".join(varied) if varied else next((v.split("=", 1)[1] for v in variant if v.startswith("sampler=")),
                                                "plan")


def stream_plan(cfg):
    """Simulate ``cfg``'s policy: over its own stages, or a synthetic corpus. Returns a StreamPlan."""
    from ccexp.data.simulate import simulate, synthetic_corpus
    from ccexp.data.sources import source_mix
    from ccexp.preflight import preflight_stream

    from ccexp.training import runner

    preflight_stream(cfg)  # also refuses an unknown plan.source
    p = cfg.plan
    if p.source == "synthetic":
        labels, sizes, lengths = synthetic_corpus(p.clusters, p.documents, zipf=p.zipf, mean_tokens=p.mean_tokens,
                                                  sigma=p.sigma, seed=cfg.seed)
        sampler, mix = runner.sampler_over(cfg.sampler, cfg.train, labels, sizes, lengths), None
    else:  # the same stages as a training run (ccexp.pipeline.run), from the cache when they are there
        from pathlib import Path

        from ccexp import stages
        from ccexp.artifacts import StageStore

        from ccexp.preflight import check_cluster_counts

        stage = stages.Stages.for_config(cfg, StageStore(Path(cfg.paths.cache).resolve()))
        corpus = stage.corpus()
        check_cluster_counts(cfg.clusterer, int((~corpus.heldout).sum()))
        pretrained = stage.model()
        tokenized = stage.tokenize(corpus, pretrained)
        mix = source_mix(cfg.data, corpus.labels)  # data.sources with weights: their target token shares
        runner.settle_budget(cfg.train, cfg.sampler, tokenized, ~corpus.heldout, mix)  # as a run: before embedding
        embeddings = stage.embed(corpus, pretrained)
        clustering = stage.cluster(corpus, embeddings)
        kept = stage.dedup(corpus, embeddings, clustering)  # the same curation as a training run
        split = stages.train_split(corpus, clustering, cfg.sampler.level,
                                   stages.select(cfg.selection, corpus, clustering, kept))
        sampler = runner.build_sampler(cfg.sampler, cfg.train, split, tokenized, sources=mix)
        lengths = tokenized.lengths(split.train_docs)
    plan = simulate(sampler, lengths, steps=cfg.train.steps, tokens_per_step=cfg.train.tokens_per_step,
                    seq_len=cfg.train.seq_len, max_doc_tokens=cfg.train.max_doc_tokens,
                    record_every=min(int(p.record_every), -(-int(cfg.train.steps) // 20)),  # >= 20 points
                    groups=None if mix is None else mix[0][split.train_docs])
    if mix is not None:
        plan.group_targets, plan.group_names = mix[1], mix[2]
        logging.getLogger("ccexp").info("plan: source token shares %s", ", ".join(
            f"{n} {t / plan.group_tokens.sum():.1%} (target {w:.1%})"
            for n, t, w in zip(mix[2], plan.group_tokens, mix[1])))
    logging.getLogger("ccexp").info(
        "plan: %s, %d steps x %s tokens in %.1f s: %d of %d clusters clipped, max repetition %d", cfg.sampler.name,
        cfg.train.steps, f"{cfg.train.tokens_per_step:,}", plan.seconds, int((plan.clipped_at >= 0).sum()),
        int((plan.sizes > 0).sum()), max(plan.repetition_histogram, default=0))
    return plan


def write_plans(plans: list, impossible: list[tuple[str, str]] | None = None):
    """``plan.md``, ``clusters.csv`` (one block per variant), ``history.csv`` and ``plan.png`` in a new
    folder under ``<paths.outputs>/plans/``, and one MLflow run per variant; ``impossible`` (label, the
    line that refused it) are listed in ``plan.md`` as variants that cannot run. Returns the folder."""
    import csv
    import time
    from pathlib import Path

    cfg0 = plans[0][1]
    out = Path(cfg0.paths.outputs).resolve() / "plans" / time.strftime("%Y-%m-%d") / f"{time.strftime('%H-%M-%S')}-" \
        f"{__import__('os').getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "clusters.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "cluster", "train_size", "documents", "tokens", "token_share", "clipped_at_step"])
        for label, _, p in plans:
            share = p.tokens / max(1, p.tokens.sum())
            for c in range(p.sizes.size):
                w.writerow([label, c, int(p.sizes[c]), int(p.documents[c]), int(p.tokens[c]), f"{share[c]:.6f}",
                            int(p.clipped_at[c])])
    with open(out / "history.csv", "w", newline="") as f:
        w = csv.writer(f)
        keys = list(plans[0][2].history)
        w.writerow(["variant", *keys])
        for label, _, p in plans:
            for row in zip(*(p.history[k] for k in keys)):
                w.writerow([label, *row])
    png = plot_plans(plans, out / "plan.png")
    p0 = cfg0.plan
    source = (f"synthetic corpus (K={p0.clusters:,}, N={p0.documents:,}, Zipf {p0.zipf}, mean {p0.mean_tokens:g} "
              f"tokens)" if p0.source == "synthetic" else f"{cfg0.data.name}, {cfg0.clusterer.name}")
    lines = [f"# Stream plan: {source}, {cfg0.train.steps} steps x {cfg0.train.tokens_per_step:,} tokens", "",
             "No model was trained: the policy's own token stream was run and counted (ccexp.data.simulate).", "",
             "| variant | clusters clipped | first clip at step | max repetition | final token-mix entropy (nats) | "
             "KL to the corpus token mix | KL to uniform | seconds |", "|---|---|---|---|---|---|---|---|"]
    for label, _, p in plans:
        clipped = p.clipped_at[p.clipped_at >= 0]
        h = p.history
        lines.append(f"| {label} | {clipped.size} of {int((p.sizes > 0).sum())} | "
                     f"{int(clipped.min()) + 1 if clipped.size else '-'} | {max(p.repetition_histogram, default=0)} | "
                     f"{h['mix_entropy'][-1]:.3f} | {h['kl_to_corpus'][-1]:.3f} | {h['kl_to_uniform'][-1]:.3f} | "
                     f"{p.seconds:.1f} |")
    lines += [f"| {label} | cannot run: {why} | | | | | | |" for label, why in impossible or []]
    sourced = [(label, p) for label, _, p in plans if p.group_tokens is not None]
    if sourced:
        lines += ["", "| variant | source | target token share | planned token share | tokens | off target (tokens) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {label} | {name} | {w:.2%} | {t / p.group_tokens.sum():.2%} | {int(t):,} | "
                  f"{int(t) - w * p.group_tokens.sum():+,.0f} |" for label, p in sourced
                  for name, t, w in zip(p.group_names, p.group_tokens, p.group_targets)]
    lines += documents_not_tokens(plans)
    lines += ["", "![plan](plan.png)", "", "Per cluster: clusters.csv; over time: history.csv."]
    (out / "plan.md").write_text("\n".join(lines) + "\n")
    log_plans(plans, out, [out / "plan.md", out / "clusters.csv", out / "history.csv", png])
    return out


def documents_not_tokens(plans: list) -> list[str]:
    """A paragraph for each variant that draws clusters more evenly by *documents* than the corpus holds them but
    trains on a token mix *less* even than the corpus's own (what random sampling gives): on a corpus whose
    clusters' documents differ in length, equal documents are unequal tokens (uniform and ClusterClip balance
    documents). It says so and names the policy that budgets tokens per cluster (UniMax, Chung et al. 2023).
    Evenness is the KL divergence to the uniform mix over the clusters that have documents, as the plan table's
    column ([`mix_statistics`][ccexp.sampling.base.mix_statistics]); [] when no variant is so, or the plan has no
    corpus token counts."""
    from ccexp.sampling.base import mix_statistics

    out = []
    for label, _, p in plans:
        if p.corpus_tokens is None or p.tokens.sum() == 0:
            continue

        def uneven(counts) -> float:  # KL(counts' mix || uniform over the clusters with documents), nats
            return mix_statistics(counts, p.sizes)["kl_to_uniform"]

        drawn, held = uneven(p.documents), uneven(p.sizes)
        trained, corpus = uneven(p.tokens), uneven(p.corpus_tokens)
        if drawn < held and trained > corpus:
            out += ["", f"{label}: drew clusters more evenly by documents than the corpus holds them (KL to uniform "
                    f"{drawn:.3f} against {held:.3f}) but trained on tokens less evenly than the corpus's own mix, "
                    f"what random sampling gives ({trained:.3f} against {corpus:.3f}): this corpus's clusters differ "
                    "in document length, so equal documents are unequal tokens. To balance the tokens each cluster "
                    "gets, `sampler=unimax` budgets tokens per cluster (UniMax, Chung et al. 2023); clusters.csv "
                    "has each cluster's tokens and documents."]
    return out


def plot_plans(plans: list, path):
    """Two panels: each cluster's share of the tokens against its share of the corpus (log-log), and
    the KL divergence of the token mix to the corpus mix over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ccexp.names import plot_text

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    seen: dict[bytes, str] = {}  # plans whose tokens coincide: drawn with their own marker and named as the same
    for i, (label, _, p) in enumerate(plans):
        same = seen.setdefault(p.tokens.tobytes(), label)
        label = label if same == label else f"{label} (= {same})"
        nz = p.corpus_tokens > 0
        corpus = p.corpus_tokens[nz] / p.corpus_tokens[nz].sum()
        share = p.tokens[nz] / max(1, p.tokens.sum())
        order = np.argsort(corpus)
        marker = ("o", "x", "+", "^", "s", "1")[i % 6]  # plans that coincide stay visible
        a.plot(corpus[order], np.maximum(share[order], 1e-12), marker, ms=4, mfc="none", ls="none",
               label=plot_text(label, 60))
        b.plot(p.history["step"], p.history["kl_to_corpus"], label=plot_text(label, 60), lw=1.2, marker=marker,
               ms=5, mfc="none", ls=("-", "--", ":", "-.")[i % 4])  # a run shorter than plan.record_every: points
    lo = min(float((p.corpus_tokens[p.corpus_tokens > 0] / p.corpus_tokens.sum()).min()) for _, _, p in plans)
    a.plot([lo, 1], [lo, 1], "k--", lw=0.8, label="= corpus token mix (random)")
    a.set(xscale="log", yscale="log", xlabel="cluster's share of the training split's tokens",
          ylabel="cluster's share of the tokens trained", title="exposure per cluster, in tokens")
    b.set(xlabel="optimizer step", ylabel="KL(trained token mix || corpus token mix), nats", title="mix over the run")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_plans(plans: list, out, files: list) -> None:
    """One MLflow run per variant in ``<logger.experiment>-plan`` (tag ``ccexp.plan``), with the files."""
    cfg0 = plans[0][1]
    if not cfg0.logger.enabled:
        return
    from pathlib import Path

    from ccexp.tracking.mlflow_run import run_store
    from ccexp.tracking.server import LOCAL_STORE, FallbackClient, client_for, start_run

    outputs = Path(cfg0.paths.outputs).resolve()
    store = run_store(cfg0.logger.tracking_uri, outputs)
    client = client_for(store, Path(out) / LOCAL_STORE)
    artifacts = cfg0.logger.artifact_location or (None if store.is_server else outputs / "mlartifacts")
    for label, cfg, p in plans:
        rid = start_run(client, f"{cfg0.logger.experiment}-plan", f"plan-{label}".replace(" ", "_")[:200],
                        {"ccexp.plan": "true", "sampler": cfg.sampler.name, "data": cfg.data.name}, artifacts,
                        local=not store.is_server)
        for step, kl, ent in zip(p.history["step"], p.history["kl_to_corpus"], p.history["mix_entropy"]):
            client.log_metric(rid, "plan/kl_to_corpus", kl, step=int(step))
            client.log_metric(rid, "plan/mix_entropy", ent, step=int(step))
        client.log_metric(rid, "plan/clusters_clipped", float((p.clipped_at >= 0).sum()))
        client.log_metric(rid, "plan/max_repetition", float(max(p.repetition_histogram, default=0)))
        client.log_metric(rid, "plan/seconds", p.seconds)
        for f in files:
            client.log_artifact(rid, str(f))
        client.set_terminated(rid, "FINISHED")
    if isinstance(client, FallbackClient):
        client.close()


if __name__ == "__main__":
    from ccexp.runtime import run_command

    run_command(main)
