"""Pre-flight: every check of a composed config, in one call, before any stage runs — so a bad option
costs seconds, not an embedding pass. Each failure is one [`CcexpError`][ccexp.errors.CcexpError] line naming the key and
the fix.

What is checked where: keys and lower bounds come from the schemas ([`ccexp.config`][ccexp.config], the one
place they are written); a component's own options are checked by its constructor, which
pre-flight calls on a stand-in (the sampler over K one-document clusters, the clusterer, the
embedder without loading its model); cross-field rules (the token budget over ranks and
micro-batches, the model's context against ``seq_len``, a GPU for a GPU trainer) are here.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ccexp import config as schemas
from ccexp.build import build, check_buildable
from ccexp.compare.verdict import check_primary
from ccexp.embedding.shards import launch_rank
from ccexp.errors import CcexpError
from ccexp.tracking.loggers import trial_start

log = logging.getLogger("ccexp")

_PRECISIONS = {"64", "64-true", "32", "32-true", "16", "16-mixed", "bf16", "bf16-mixed", "16-true", "bf16-true",
               "transformer-engine", "transformer-engine-float16"}
_GROUPS_WITH_TARGETS = ("data", "embedder", "clusterer", "sampler", "model", "trainer")


def preflight(cfg: DictConfig, multirun: bool = False) -> None:
    """Raise [`CcexpError`][ccexp.errors.CcexpError] for the first invalid setting in ``cfg`` (``multirun``: the run is a
    job of a sweep, where a strategy that re-launches the script is refused)."""
    _check_keys_and_bounds(cfg, schemas.RootConfig, "")
    _check_missing(cfg)
    if multirun:
        refuse_relaunch_in_multirun(cfg)
    for key in ("seed", "train.init_seed", "sampler.seed", "clusterer.seed", "selection.seed", "curate.dedup.seed"):
        value = OmegaConf.select(cfg, key)
        if value is not None and not 0 <= value < 2**32:
            raise CcexpError(f"{key}={value} is out of range; use an integer in [0, 2**32)")
    if not (0 < cfg.report.min_effect < 1 and 0 < cfg.report.power < 1):
        raise CcexpError(f"report.min_effect={cfg.report.min_effect} and report.power={cfg.report.power} must be in "
                         "(0, 1)")
    check_primary(cfg.report.primary)
    if cfg.train.max_steps is not None and cfg.train.passes is None:
        raise CcexpError(f"train.max_steps={cfg.train.max_steps} caps the steps train.passes gives, and train.passes "
                         "is not set; set train.steps instead, or give train.passes too")
    if cfg.train.passes is not None and not 0 < cfg.train.passes < float("inf"):
        raise CcexpError(f"train.passes={cfg.train.passes} must be a finite number > 0 (passes over the training "
                         "tokens), or null")
    if not cfg.train.lr > 0:
        raise CcexpError(f"train.lr={cfg.train.lr} must be > 0")
    check_resume_from(cfg.train.resume_from, sharded=str(cfg.trainer.strategy).startswith("fsdp"))
    from ccexp.clustering.selection import check_strategy
    from ccexp.data.corpus import check_heldout_fraction

    check_heldout_fraction(cfg.data.heldout_fraction)
    if cfg.data.heldout_stratify not in (None, "auto") and cfg.data.heldout_stratify not in cfg.data.label_fields:
        raise CcexpError(f"data.heldout_stratify={cfg.data.heldout_stratify!r} is not among data.label_fields "
                         f"{list(cfg.data.label_fields)}; add it, e.g. data.label_fields=[{cfg.data.heldout_stratify}]")
    check_strategy(cfg.selection.strategy)
    if cfg.curate.dedup.enabled:
        from ccexp.clustering.dedup import check_options

        check_options(cfg.curate.dedup.threshold, cfg.curate.dedup.keep)
    for group in _GROUPS_WITH_TARGETS:
        check_buildable(cfg[group], group)
    built = {}
    for group, entries in (("callbacks", cfg.callbacks), ("logger.loggers", cfg.logger.loggers)):
        for name, entry in (entries or {}).items():
            if entry is not None:
                built[f"{group}.{name}"] = _check_extra(entry, f"{group}.{name}")
    _check_callbacks_have_a_logger(cfg, built)
    if launch_rank()[0] == 0:  # the rank that records the run: each extra logger started once, in a scratch folder
        for name, entry in (cfg.logger.loggers or {}).items():
            if entry is not None:
                trial_start(entry, f"logger.loggers.{name}")
    if cfg.train.on_nonfinite not in ("stop", "skip_batch"):
        raise CcexpError(f"train.on_nonfinite={cfg.train.on_nonfinite!r} is not an option; use stop or skip_batch")
    _check_trainer(cfg)
    check_launch(cfg.trainer)
    _check_token_budget(cfg)
    _check_eval(cfg)
    _check_model(cfg)
    _check_components(cfg)
    _check_outputs(cfg)


def _check_extra(entry: DictConfig, key: str):
    """A callback or logger entry is built now (they are cheap to make), so a value its class refuses is one
    line before any stage, not a traceback when training starts; returns what was built."""
    check_buildable(entry, key)
    try:
        return build(entry, key)
    except CcexpError:
        raise
    except Exception as e:  # noqa: BLE001 (each library's own exception: the line names the entry)
        line = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise CcexpError(f"{key}: {line.strip()}") from None


def _check_callbacks_have_a_logger(cfg: DictConfig, built: dict) -> None:
    """A callback that writes to the loggers (Lightning's LearningRateMonitor and DeviceStatsMonitor refuse a
    trainer without one when training starts) in a run with none (``logger=none`` and no ``logger.loggers``)
    is one line here, before any stage."""
    from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor

    if cfg.logger.enabled or any(k.startswith("logger.loggers.") for k in built):
        return
    for key, callback in built.items():
        if isinstance(callback, (LearningRateMonitor, DeviceStatsMonitor)):
            raise CcexpError(f"{key} ({type(callback).__name__}) writes to a logger and logger={cfg.logger.name} has "
                             "none; use logger=mlflow or logger=tensorboard, or drop the callback (callbacks=none)")


def _check_outputs(cfg: DictConfig) -> None:
    out = Path(cfg.paths.outputs).expanduser()
    if out.exists() and not out.is_dir():
        raise CcexpError(f"paths.outputs={str(out)!r} is a file; give a folder for ccexp's outputs")


def check_inputs(cfg: DictConfig) -> None:
    """The checks that need neither torch nor a model, run first (in about a second): keys and bounds,
    required values, the corpus's path and format, ``paths.outputs``, and the MLflow store (said in the
    run's first line; a tracking server must answer).

    Raises:
        CcexpError: for the first problem.
    """
    _check_keys_and_bounds(cfg, schemas.RootConfig, "")
    _check_missing(cfg)
    _check_sources(cfg.data)
    _check_outputs(cfg)
    from ccexp.tracking.mlflow_run import check_store

    check_store(cfg.logger, Path(cfg.paths.outputs).expanduser().resolve())


def _check_sources(data: DictConfig) -> None:
    """``data.path`` (or each of ``data.sources``, with their names and weights) exists in its format."""
    from ccexp.data.corpus import check_source
    from ccexp.data.sources import SOURCE_FIELD, source_entries, source_names, source_weights

    if data.sources:
        if data.path != "sources":
            raise CcexpError("data.sources are read with data=sources; add data=sources to the command")
        if SOURCE_FIELD not in data.label_fields:
            raise CcexpError(f"data.label_fields={list(data.label_fields)} lacks 'source', the label data=sources "
                             f"gives every document; use data.label_fields=[source,{','.join(data.label_fields)}]")
        source_names(data.sources)
        source_weights(data.sources)
        for i, s in enumerate(source_entries(data.sources)):
            try:
                check_source(str(s["path"]), data.format)
            except CcexpError as e:  # the reader's line names data.path: here it is this source's path
                raise CcexpError(str(e).replace("data.path", f"data.sources[{i}].path")) from None
    elif data.path == "sources":
        raise CcexpError("data=sources needs data.sources=[{path: ..., weight: ...}, ...]")
    elif data.path != "builtin":
        check_source(data.path, data.format)


def sweep_choices(overrides: list[str]) -> dict[str, list[str]]:
    """Each key's overrides in Hydra's override grammar, in order: ``key=v`` per value of a comma list or
    range, or the override itself; a key given twice keeps its first place and its last value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: dict[str, list[str]] = {}
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        key = o.get_key_element()
        choices[key] = ([f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                        else [o.input_line])
    return choices


def check_sweep_values(overrides: list[str], compose=None) -> None:
    """Every value of every comma list of a sweep (or of a plan's variants) composed, and its keys and
    bounds checked, before any job or stage: each value once, with the other keys at their first value, so
    a value that is not an option (``sampler=random,nope``, a misspelt key, ``+train.lrr=0.1,0.2``, a wrong
    type, a value out of its schema's bounds) is one line at the start, not a failure when its job starts
    (after the others trained, or after the plan embedded). A value that composes but that its job
    refuses (``sampler.clip_threshold=0``) fails that job alone, with its line, as before.

    Args:
        overrides: the sweep's overrides (Hydra's grammar: ``a=1,2 b=x``).
        compose: ``overrides -> config``; by default [`ccexp.config.compose`][ccexp.config.compose] (outside a running Hydra app).

    Raises:
        CcexpError: naming the value that is not an option and why.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ccexp.errors import one_line

    if compose is None:
        from ccexp.config import compose
    choices = sweep_choices(overrides)
    first = [values[0] for values in choices.values()]
    variants: list[tuple[str | None, list[str]]] = [(None, first)]
    for i, values in enumerate(choices.values()):
        rest = values[1:]
        raw = [v.split("=", 1)[1] for v in values]
        if len(values) > 2 and all(re.fullmatch(r"-?\d+", v) for v in raw):  # integers: the bounds are what fails
            key = values[0].split("=", 1)[0]
            rest = [f"{key}={n}" for n in sorted({min(map(int, raw)), max(map(int, raw))})]
        variants += [(v, first[:i] + [v] + first[i + 1:]) for v in rest]
    if any(key.lstrip("+~") == "report.primary" and len(values) > 1 for key, values in choices.items()):
        raise CcexpError("report.primary is the comparison's one question and cannot be swept: set one value (the "
                         "report of the same runs can decide another, post hoc: python -m ccexp.report --primary ...)")
    for value, variant in variants:
        try:
            composed = compose(variant)
            _check_keys_and_bounds(composed, schemas.RootConfig, "")
            check_primary(composed.report.primary)
        except (CcexpError, HydraException, OmegaConfBaseException) as e:
            why = str(e) if isinstance(e, CcexpError) else one_line(e)
            raise CcexpError(f"the sweep's value {value} is not an option: {why}" if value else why) from None


RESUME_WORDS = ("last", "auto", "fresh")


def check_resume_from(value, sharded: bool = True) -> None:
    """``train.resume_from`` is null, one of ``RESUME_WORDS``, or a checkpoint that exists (a ``.ckpt`` file, or
    the folder of a sharded one, which only an FSDP trainer reads: ``sharded``), before any stage runs.

    Raises:
        CcexpError: naming the value and what it may be (the word it most likely means).
    """
    if value is None or str(value) in RESUME_WORDS:
        return
    from pathlib import Path

    text = str(value)
    near = next((w for w in RESUME_WORDS if text.strip().lower().startswith(w[:3]) and len(text) <= len(w) + 2), None)
    what = "train.resume_from takes last, auto, fresh or a checkpoint's path"
    if near is not None and not Path(text).exists():
        raise CcexpError(f"train.resume_from={text!r} is not an option; did you mean {near!r}? ({what})")
    path = Path(text).expanduser()
    if not text.strip() or not path.exists():
        raise CcexpError(f"train.resume_from={text!r}: no such checkpoint; {what} "
                         "(<run>/checkpoints/last.ckpt)")
    if path.is_dir() and not (path / "meta.pt").is_file() and not any(path.glob("*.distcp")):
        raise CcexpError(f"train.resume_from={text!r} is a folder, not a checkpoint; give a .ckpt file in it (or "
                         "train.resume_from=last)")
    if path.is_dir() and not sharded:
        raise CcexpError(f"train.resume_from={text!r} is a sharded (FSDP) checkpoint folder; continue it with the FSDP "
                         "trainer it was written by (trainer.strategy=fsdp), or export it first (train.save_model=true "
                         "writes <run>/model)")


def preflight_stream(cfg: DictConfig) -> None:
    """The checks that a model-free stream plan needs ([`ccexp.plan`][ccexp.plan]): keys and bounds, the token
    budget over ranks and micro-batches, and the sampler, clusterer and embedder's own options.

    Raises:
        CcexpError: for the first invalid setting.
    """
    _check_keys_and_bounds(cfg, schemas.RootConfig, "")
    if cfg.plan.source != "synthetic":  # a synthetic plan reads no corpus
        _check_missing(cfg)
    if cfg.plan.source not in ("corpus", "synthetic"):
        raise CcexpError(f"plan.source={cfg.plan.source!r} is not an option; use corpus or synthetic")
    if cfg.plan.source == "synthetic" and cfg.plan.clusters > cfg.plan.documents:
        raise CcexpError(f"plan.clusters={cfg.plan.clusters} is more than plan.documents={cfg.plan.documents}: every "
                         f"synthetic cluster needs a document; set plan.clusters <= {cfg.plan.documents}")
    _check_token_budget(cfg)
    _check_components(cfg)


def relaunching_strategy(cfg: DictConfig) -> bool:
    """True when Lightning would start the other ranks by re-running this script (``ddp``, ``fsdp``, ...
    on several devices, not under torchrun or srun): inside a multirun each child would re-run the sweep."""
    strategy = str(cfg.trainer.strategy)
    external = "LOCAL_RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1
    if external or not strategy.startswith(("ddp", "fsdp", "deepspeed")) or any(
            k in strategy for k in ("spawn", "fork", "notebook")):
        return False
    try:
        return schemas.world_size(cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.accelerator) > 1
    except CcexpError:
        return True


def refuse_relaunch_in_multirun(cfg: DictConfig) -> None:
    """Raise the one-line refusal of [`relaunching_strategy`][ccexp.preflight.relaunching_strategy] (in a multirun only).

    Raises:
        CcexpError: naming the strategy and the launchers that work.
    """
    if relaunching_strategy(cfg):
        raise CcexpError(f"trainer.strategy={cfg.trainer.strategy} starts its other processes by re-running the "
                         "command, which inside a sweep (-m) would re-run the whole sweep; use "
                         "trainer.strategy=ddp_spawn, or start the processes with torchrun or the Slurm launcher")


def _check_keys_and_bounds(node: DictConfig, schema: type, prefix: str) -> None:
    """Unknown keys and the ``ge(low)`` bounds of ``schema``'s fields, recursively (a group's schema
    is the one registered for its ``_target_``). A value set directly is named before one that only
    follows it by interpolation (``eval.max_tokens`` follows ``train.seq_len``: the error names the
    setting to change)."""
    derived: list[str] = []
    _walk_keys_and_bounds(node, schema, prefix, derived)
    if derived:
        raise CcexpError(derived[0])


def _walk_keys_and_bounds(node: DictConfig, schema: type, prefix: str, derived: list[str]) -> None:
    import typing

    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields:
            import difflib

            known = ", ".join(sorted(k for k in fields if not k.startswith("_")))
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise CcexpError(f"{prefix}{key} is not a setting of {prefix[:-1]}{hint} (known: {known})" if prefix else
                             f"{key} is not a ccexp setting{hint} (top-level settings: {known})")
    hints = typing.get_type_hints(schema)
    for key, f in fields.items():
        if key not in node:
            continue
        low = f.metadata.get("min")
        if low is not None:
            value = OmegaConf.select(node, key)
            optional = type(None) in typing.get_args(hints[key])
            if value < low if value is not None else not optional:
                message = f"{prefix}{key}={value} is out of range; it must be >= {low}"
                if not node._get_node(key)._is_interpolation():
                    raise CcexpError(message)
                derived.append(message)
        child = node._get_node(key)  # the node itself: an interpolation is not resolved here
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            sub = schemas.child_schema(schema, key, child)
            if sub is not None:
                _walk_keys_and_bounds(child, sub, f"{prefix}{key}.", derived)


def _check_trainer(cfg: DictConfig) -> None:
    t = cfg.trainer
    if str(t.precision) not in _PRECISIONS:
        raise CcexpError(f"trainer.precision={t.precision!r} is not an option; use one of {', '.join(sorted(_PRECISIONS))}")
    check_devices(t)
    check_fsdp_options(t)
    if t.accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CcexpError(no_gpu_line(cfg))


def no_gpu_line(cfg: DictConfig) -> str:
    """The line for a trainer on CUDA GPUs where none is visible. FSDP (a recipe's, such as
    ``+recipe=llama2_7b``) is not sent to ``trainer=cpu``, which drops it and would train a 7B model in fp32
    in one process: the line names the documented CPU route (gloo, fp32, a model that fits) and the plan."""
    t = cfg.trainer
    recipe = cfg.get("recipe_name")
    named = f"trainer={t.name}" + (f" (+recipe={recipe}'s)" if recipe else "")
    cpu = "trainer.accelerator=cpu trainer.precision=32-true"
    if str(t.get("strategy")) == "fsdp":
        return (f"{named} needs a CUDA GPU and none is visible; FSDP runs on the CPU with {cpu} and a model that fits "
                "it (model.pretrained=<a small model's folder>, e.g. one scripts/make_tiny_llama.py makes: "
                "docs/using.md, \"On a CPU\"), and python -m ccexp.plan model <these overrides> says what this run "
                "needs per GPU")
    return (f"{named} needs a CUDA GPU and none is visible; on the CPU use trainer=cpu (one process), or add {cpu} "
            "(gloo ranks)")


def check_launch(t: DictConfig) -> None:
    """Under torchrun, ``trainer.devices`` x ``trainer.num_nodes`` are the launch's ranks (its ``WORLD_SIZE``):
    the token budget is split over the configured ranks, and Lightning refuses a count that differs only
    when training starts, after every stage, with a traceback.

    Raises:
        CcexpError: naming torchrun's processes per node and nodes, and the settings that match them.
    """
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "WORLD_SIZE" not in env:
        return
    world = int(env["WORLD_SIZE"])
    per_node = int(env.get("LOCAL_WORLD_SIZE", world))
    configured = schemas.world_size(t.devices, t.num_nodes, t.accelerator)
    if configured != world:
        raise CcexpError(f"trainer.devices={t.devices} x trainer.num_nodes={t.num_nodes} is {configured} rank(s), but "
                         f"torchrun started {world} ({world // max(1, per_node)} node(s) x {per_node} process(es)); "
                         f"use trainer.devices={per_node} trainer.num_nodes={world // max(1, per_node)}")


def _check_missing(cfg: DictConfig) -> None:
    """Raise one line naming the first required value (``???``) left unset."""
    missing = _missing_keys(cfg)
    if missing:
        raise CcexpError(f"{missing[0]} is required and has no value; set it on the command line, e.g. {missing[0]}=...")


def _missing_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Full keys of ``???`` values, found without resolving any interpolation."""
    out = []
    for key in node.keys():
        child = node._get_node(key)
        if child._is_missing():
            out.append(f"{prefix}{key}")
        elif isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
            out += _missing_keys(child, f"{prefix}{key}.")
    return out


def check_devices(t: DictConfig) -> None:
    """``trainer.devices`` is a count >= 1, -1 (all), 'auto' or a list of ids, and ``trainer.num_nodes`` >= 1.

    Raises:
        CcexpError: naming the setting and what it may be.
    """
    devices = t.devices
    if not (devices == "auto" or (isinstance(devices, int) and not isinstance(devices, bool) and
                                  (devices >= 1 or devices == -1)) or OmegaConf.is_list(devices)):
        raise CcexpError(f"trainer.devices={devices!r} is not valid; use a count >= 1, -1 (all), 'auto' or a list of ids")
    if not isinstance(t.num_nodes, int) or t.num_nodes < 1:
        raise CcexpError(f"trainer.num_nodes={t.num_nodes!r} is not valid; use a count >= 1")


def check_fsdp_options(t: DictConfig) -> None:
    """``trainer.fsdp.*`` hold known values (checked whatever the strategy, so a typo never waits for a GPU run).

    Raises:
        CcexpError: naming the key and its options.
    """
    f = t.fsdp
    for key, value, options in (("auto_wrap", f.auto_wrap, ("decoder_layer", None)),
                                ("sharding_strategy", f.sharding_strategy,
                                 ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")),
                                ("state_dict_type", f.state_dict_type, ("sharded", "full")),
                                ("load_weights", f.load_weights, ("rank0", "every_rank"))):
        if value not in options:
            raise CcexpError(f"trainer.fsdp.{key}={value!r} is not an option; use "
                             + " or ".join("null" if o is None else o for o in options))


def _check_token_budget(cfg: DictConfig) -> None:
    """The step's tokens split into rows and micro-batches on every rank; the derived accumulation was
    not overridden by hand."""
    t = cfg.train
    world = schemas.world_size(cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.accelerator)
    derived = schemas.grad_accumulation(t.tokens_per_step, t.seq_len, t.micro_batch_size, world)
    node = OmegaConf.to_container(t, resolve=False)["grad_accumulation"]
    if node != schemas.GRAD_ACCUMULATION and int(node) != derived:
        raise CcexpError(f"train.grad_accumulation={node} but it is derived: tokens_per_step / (seq_len x "
                         f"micro_batch_size x world size) = {derived}; set train.tokens_per_step or "
                         "train.micro_batch_size instead")
    prior = schemas.component("sampler", cfg.sampler).prior_run(cfg.sampler)
    if world > 1 and prior is not None:
        setting = {"reference": "sampler.reference_losses=auto", "proxy": "sampler.weights=doremi"}.get(prior, "sampler")
        output = {"reference": "reference_losses.npy", "proxy": "weights.npy"}.get(prior, "")
        raise CcexpError(f"{setting} trains DoReMi's {prior} model on one device, not under {world} ranks; pass a file: "
                         f"a single-device run of this config writes it to <paths.cache>/{prior}/<fingerprint>/{output}")


def _check_eval(cfg: DictConfig) -> None:
    """The averaged weights' options; a warning when the held-out scoring reaches positions that a model
    trained from scratch never trained (``eval.max_tokens`` > ``train.seq_len``)."""
    e = cfg.eval
    if e.average not in ("none", "ema", "tail"):
        raise CcexpError(f"eval.average={e.average!r} is not an option; use ema, tail or none")
    if not 0.0 < float(e.average_span) <= 1.0:
        raise CcexpError(f"eval.average_span={e.average_span} must be in (0, 1]: the fraction of the run averaged")
    if e.average != "none" and str(cfg.trainer.strategy).startswith("fsdp"):
        raise CcexpError(f"eval.average={e.average} keeps a whole copy of the weights, which trainer.strategy=fsdp "
                         "shards across ranks; set eval.average=none")
    if schemas.component("model", cfg.model).weights_source(cfg.model) is None and e.max_tokens > cfg.train.seq_len:
        log.warning("eval.max_tokens=%d scores positions up to %d, but the model is trained from scratch on rows of "
                    "train.seq_len=%d tokens and never trained a later position; leave eval.max_tokens at its default "
                    "(train.seq_len)", e.max_tokens, e.max_tokens, cfg.train.seq_len)


def _check_model(cfg: DictConfig) -> None:
    """The model's own cross-checks (declared on its schema), the tokenizer kind, an embedder's causal LM, and
    lm-eval's tasks being cached."""
    from ccexp.data.tokenize import check_tokenizer_kind
    from ccexp.model_source import require_local_model

    check_tokenizer_kind(cfg.model.tokenizer.kind)
    schemas.component("model", cfg.model).check(cfg.model, max(cfg.train.seq_len, cfg.eval.max_tokens))
    embedder = schemas.component("embedder", cfg.embedder)
    if "pretrained" in embedder.needs and not embedder.uses_run_model(cfg.embedder):
        require_local_model(cfg.embedder.model, "embedder.model", causal_lm=True, tokenizer=True)
    if cfg.eval.lm_eval is not None:
        from ccexp.evaluation.lm_eval_bridge import check_lm_eval

        check_lm_eval(cfg.eval.lm_eval)


def _check_components(cfg: DictConfig) -> None:
    """The constructors judge their own options: the clusterer, the embedder (its model is found, not
    loaded) and the sampler on K one-document clusters, which must also lay out a step's rows."""
    build(cfg.clusterer, "clusterer")
    build(cfg.embedder, "embedder")
    if schemas.component("embedder", cfg.embedder).uses_run_model(cfg.embedder) and \
            schemas.component("model", cfg.model).weights_source(cfg.model) is None:
        raise CcexpError(f"embedder={cfg.embedder.name} embeds with the run's pretrained model but model="
                         f"{cfg.model.name} has none; use model=hf_causal_lm model.pretrained=... (or +recipe=cluster_sft)")
    k = cluster_count(cfg)
    sampler = schemas.component("sampler", cfg.sampler)
    sampler.check_inputs(cfg.sampler)  # the files it reads, whatever K turns out to be
    inputs = {"similarity": np.zeros(k, dtype=np.float32), "cluster_names": None}
    extra = {**{name: inputs[name] for name in sampler.needs}, **sampler.stand_in(cfg.sampler, k)}
    built = build(cfg.sampler, "sampler", labels=np.arange(k, dtype=np.int32), sizes=np.ones(k, dtype=np.int64),
                  **extra)
    built.row_lanes(cfg.train.tokens_per_step // cfg.train.seq_len)


def check_cluster_counts(clusterer: DictConfig, train_documents: int) -> None:
    """Once the corpus is read, before any embedding: no clustering level asks for more clusters than there
    are training documents (the clusterer's own check, [`ccexp.clustering.kmeans.check_k`][ccexp.clustering.kmeans.check_k]).

    Raises:
        CcexpError: naming the setting and the number of training documents.
    """
    from ccexp.clustering.kmeans import check_k

    declared = schemas.component("clusterer", clusterer)
    counts = declared.cluster_counts(clusterer)
    if counts is not None:
        check_k(max(counts), train_documents, declared.count_key(clusterer))


def cluster_count(cfg: DictConfig) -> int:
    """K at the level the sampler balances, as the clusterer declares its levels (1 for groups from a label,
    whose K is the number of label values, known once the corpus is read).

    Raises:
        CcexpError: if ``sampler.level`` is not a level of the clusterer, or the label field is not read.
    """
    declared = schemas.component("clusterer", cfg.clusterer)
    field = declared.group_field(cfg.clusterer)
    if field is not None and field not in cfg.data.label_fields:
        raise CcexpError(f"clusterer.label_field={field!r} is not among data.label_fields "
                         f"{list(cfg.data.label_fields)}; add it, e.g. data.label_fields=[{field}]")
    levels = declared.cluster_counts(cfg.clusterer) or [1]
    from ccexp.clustering.kmeans import check_level

    check_level(int(cfg.sampler.level), levels, f"clusterer={cfg.clusterer.name}")
    return int(levels[int(cfg.sampler.level)])
