"""Config schemas (dataclasses) registered in Hydra's ConfigStore: the one place where every setting,
its default and its range are written.

Every config group option lists its schema first in its defaults list (``/schema_<group>_<name>``),
so a misspelt key or a wrong type fails at compose time naming the key; the YAML options under
``ccexp/conf/`` set only what differs from the schema. A field's lower bound sits next to it
(``ge(low, default)``) and :func:`ccexp.preflight.preflight` checks it before any work; values that
only a component can judge (a sampler's options, a clusterer's levels) are checked by its
constructor, which pre-flight calls on a stand-in.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ccexp.errors import CcexpError


def ge(low: float, default: Any = MISSING, **kw) -> Any:
    """A field whose value must be ``>= low`` (None passes for Optional fields), checked by pre-flight."""
    return field(default=default, metadata={"min": low}, **kw)


@dataclass
class PathsConfig:
    outputs: str = "outputs"  # Hydra runs, the stage cache and the MLflow store live here
    cache: str = "${paths.outputs}/cache"


def world_size(devices: Any, num_nodes: int, accelerator: str) -> int:
    """Data-parallel ranks of a Lightning ``Trainer(devices, num_nodes, accelerator)``.

    ``devices`` is a count, a list of device ids, or ``-1``/``"auto"`` (every visible GPU; one CPU process).

    Raises:
        CcexpError: for ``devices=-1`` on the CPU (Lightning needs a process count there).
    """
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        per_node = len(devices)
    elif devices in (-1, "-1", "auto"):
        if accelerator in ("gpu", "cuda"):
            import torch

            per_node = max(1, torch.cuda.device_count())
        elif devices == "auto":
            per_node = 1
        else:
            raise CcexpError("trainer.devices=-1 means every GPU; on the CPU give a process count, e.g. trainer.devices=2")
    else:
        per_node = int(devices)
    return per_node * int(num_nodes)


def grad_accumulation(tokens_per_step: int, seq_len: int, micro_batch_size: int, world: int) -> int:
    """Micro-batches per optimizer step per rank: ``tokens_per_step / (seq_len · micro_batch_size · world)``.

    Raises:
        CcexpError: if the step's tokens do not split into whole rows, or its rows into whole
            micro-batches on every rank (the message gives values that do).
    """
    if tokens_per_step < 1 or seq_len < 1 or micro_batch_size < 1:
        raise CcexpError(f"train.tokens_per_step={tokens_per_step}, train.seq_len={seq_len} and "
                         f"train.micro_batch_size={micro_batch_size} must all be >= 1")
    if tokens_per_step % seq_len:
        raise CcexpError(f"train.tokens_per_step={tokens_per_step} is not a whole number of rows of "
                         f"train.seq_len={seq_len} tokens; use a multiple of {seq_len}, e.g. "
                         f"{max(1, round(tokens_per_step / seq_len)) * seq_len}")
    rows, per_pass = tokens_per_step // seq_len, micro_batch_size * world
    if rows % per_pass:
        per_rank, rest = divmod(rows, world)
        divisor = 0 if rest else max(d for d in range(1, micro_batch_size + 1) if per_rank % d == 0)
        hint = (f"train.micro_batch_size={divisor}" if divisor else
                f"train.tokens_per_step={-(-rows // per_pass) * per_pass * seq_len}")
        raise CcexpError(f"train.tokens_per_step={tokens_per_step} is {rows} rows of {seq_len} tokens, which do not "
                         f"split into micro-batches of train.micro_batch_size={micro_batch_size} rows on {world} "
                         f"rank(s) ({per_pass} rows per pass); use e.g. {hint}")
    return rows // per_pass


def _grad_accumulation_resolver(tokens_per_step, seq_len, micro_batch_size, devices, num_nodes, accelerator) -> int:
    return grad_accumulation(int(tokens_per_step), int(seq_len), int(micro_batch_size),
                             world_size(devices, int(num_nodes), str(accelerator)))


OmegaConf.register_new_resolver("ccexp.grad_accumulation", _grad_accumulation_resolver, replace=True)
# the process id in run folder names: runs started in the same second never share a folder
OmegaConf.register_new_resolver("ccexp.pid", lambda: os.getpid(), replace=True)
GRAD_ACCUMULATION = ("${ccexp.grad_accumulation:${train.tokens_per_step},${train.seq_len},${train.micro_batch_size},"
                     "${trainer.devices},${trainer.num_nodes},${trainer.accelerator}}")


@dataclass
class TrainConfig:
    steps: int = ge(1, 1000)  # optimizer steps
    tokens_per_step: int = ge(1, 2048)  # target tokens per optimizer step, all ranks together (a multiple of seq_len)
    micro_batch_size: int = ge(1, 16)  # rows of seq_len tokens per forward pass per rank: what sets peak memory
    # derived: micro-batches per optimizer step per rank = tokens_per_step / (seq_len · micro_batch_size · world size)
    grad_accumulation: int = GRAD_ACCUMULATION  # type: ignore[assignment]
    seq_len: int = ge(2, 128)  # input tokens per row
    max_doc_tokens: Optional[int] = ge(1, None)  # cap on the tokens taken from one document (cut tokens are counted)
    document_mask: bool = False  # attend only within each document (per-document position ids)
    on_nonfinite: str = "stop"  # stop | skip_batch: what a NaN/inf training loss does (a bad gradient always stops)
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup_steps: int = ge(0, 20)
    log_every_n_steps: int = ge(1, 10)
    resume_from: Optional[str] = None  # a checkpoint to resume (<run>/checkpoints/last.ckpt), or "last": this run's newest
    checkpoint_every_n_steps: Optional[int] = ge(1, None)  # also keep checkpoints/step-N.ckpt every N steps
    record_batches: bool = False  # save each rank's trained documents per step to <run>/batches/


@dataclass
class DataConfig:
    _target_: str = "ccexp.data.corpus.read_corpus"
    name: str = MISSING
    path: str = MISSING  # a .jsonl(.gz) / .parquet file, or "builtin"
    format: str = "auto"  # auto | jsonl | parquet
    text_field: str = "text"
    id_field: Optional[str] = "id"
    label_fields: list[str] = field(default_factory=list)
    drop_empty: bool = True
    max_documents: Optional[int] = ge(1, None)
    heldout_fraction: float = 0.05  # in (0, 1): documents held out by a hash of their id


@dataclass
class EmbedderConfig:
    _target_: str = "ccexp.embedding.sentence.SentenceEmbedder"
    name: str = MISSING
    model: str = MISSING
    batch_size: int = ge(1, 64)
    max_seq_length: int = ge(1, 256)
    device: str = "auto"
    shard_size: int = ge(1, 2048)  # documents per shard: the unit of progress, resume and rank assignment
    long_documents: str = "truncate"  # truncate | chunk_mean: documents longer than max_seq_length tokens


@dataclass
class KMeansConfig:
    _target_: str = "ccexp.clustering.kmeans.FaissKMeans"
    name: str = "kmeans"
    k: int = ge(1, 32)
    niter: int = ge(1, 20)
    seed: int = "${seed}"  # type: ignore[assignment]
    max_points_per_centroid: int = ge(1, 256)
    spherical: bool = True
    nredo: int = 1
    assign_batch: int = 65536
    device: str = "auto"  # auto (GPU when FAISS has one) | cpu | gpu
    verbose: bool = False


@dataclass
class HierarchicalConfig:
    _target_: str = "ccexp.clustering.hierarchical.HierarchicalKMeans"
    name: str = "hierarchical"
    levels: list[int] = field(default_factory=lambda: [128, 32, 8])  # finest first
    niter: int = ge(1, 20)
    seed: int = "${seed}"  # type: ignore[assignment]
    resampling_steps: Any = 0  # per level, or one value
    sample_size: Any = 10  # points per cluster in a resampling step, per level or one value
    sampling: str = "closest"  # closest | random
    max_points_per_centroid: int = ge(1, 256)
    spherical: bool = True
    assign_batch: int = 65536
    device: str = "auto"
    verbose: bool = False


@dataclass
class SelectionConfig:
    """Balanced selection (Vo et al. 2024 §3.2): keep ``target`` training documents, water-filled over
    the clustering's levels from the coarsest down (:mod:`ccexp.clustering.selection`); null = keep all."""

    target: Optional[int] = ge(1, None)
    strategy: str = "random"  # random | closest (to the finest centroid)


@dataclass
class SamplerConfig:
    _target_: str = MISSING
    name: str = MISSING
    level: int = 0  # the clustering level to balance at (hierarchical clusterers; 0 = finest)


@dataclass
class RandomConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.RandomSampler"


@dataclass
class UniformConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.UniformSampler"


@dataclass
class ClusterClipConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.ClusterClipSampler"
    clip_threshold: int = 5
    after_clip: str = "uniform"  # uniform | proportional
    on_exhausted: str = "error"  # error | reset


@dataclass
class DynamicConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.DynamicSampler"
    rule: str = "odm"  # odm | doremi
    update_every: int = 10
    warmup_steps: int = 50
    beta: float = 0.9
    eta: float = 1.0
    epsilon: float = 1e-3
    reference_losses: Optional[Any] = None  # DoReMi: list, .npy or .json with one loss per cluster
    clip_threshold: Optional[int] = None
    on_exhausted: str = "error"


@dataclass
class ClusterDPConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.ClusterDPSampler"
    ratio: float = 1.0
    keep: str = "farthest"  # farthest | closest | random
    layout: str = "blocked"  # blocked | interleaved


@dataclass
class TokenizerConfig:
    kind: str = "bpe"  # bpe (trained locally) | pretrained (from model.pretrained)
    vocab_size: int = ge(300, 4096)  # a byte-level BPE needs its 256 bytes and merges
    path: Optional[str] = None


@dataclass
class TinyGPTConfig:
    _target_: str = "ccexp.training.models.tiny_gpt"
    name: str = "tiny_gpt"
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 512
    dropout: float = 0.0
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass
class HFCausalLMConfig:
    _target_: str = "ccexp.training.models.hf_causal_lm"
    name: str = MISSING
    pretrained: str = MISSING
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    tokenizer: TokenizerConfig = field(default_factory=lambda: TokenizerConfig(kind="pretrained", path=None))


@dataclass
class TrainerConfig:
    _target_: str = "lightning.pytorch.Trainer"
    name: str = MISSING
    accelerator: str = "cpu"
    devices: Any = 1
    num_nodes: int = ge(1, 1)
    strategy: str = "auto"
    precision: str = "32-true"
    gradient_clip_val: Optional[float] = 1.0
    threads: Optional[int] = ge(1, None)  # torch.set_num_threads on CPU; None = torch's default
    enable_progress_bar: bool = True


@dataclass
class LoggerConfig:
    name: str = MISSING
    enabled: bool = True
    tracking_uri: Optional[str] = None  # default sqlite:///<paths.outputs>/mlflow.db
    artifact_location: Optional[str] = None  # default <paths.outputs>/mlartifacts
    experiment: str = "ccexp"


@dataclass
class LmEvalConfig:
    local_tasks: bool = True  # per-label perplexity + a continuation multiple-choice task from held-out docs
    label_field: str = "domain"  # one perplexity task per value of this label (if the corpus has it)
    tasks: list[str] = field(default_factory=list)  # standard lm-eval tasks, if cached locally
    limit: Optional[int] = None  # documents per task
    batch_size: int = 16
    max_docs_per_task: int = 100
    mc_docs: int = 200


@dataclass
class EvalConfig:
    name: str = MISSING
    max_tokens: int = ge(1, 256)  # tokens scored per held-out document
    batch_size: int = ge(1, 32)
    max_cluster_metrics: int = ge(0, 256)  # per-cluster metrics go to MLflow when K <= this (CSV always)
    min_cluster_docs: int = ge(1, 5)  # ppl_worst considers clusters with at least this many held-out documents
    every_n_steps: Optional[int] = ge(1, 100)  # score a fixed held-out sample every N optimizer steps (curve/*); null = off
    curve_documents: int = ge(1, 128)  # size of that sample (the same documents for every run of a corpus)
    balance_report: bool = True  # plots + Markdown of the corpus vs trained cluster mix
    lm_eval: Optional[LmEvalConfig] = None


@dataclass
class RootConfig:
    data: Any = MISSING
    embedder: Any = MISSING
    clusterer: Any = MISSING
    sampler: Any = MISSING
    model: Any = MISSING
    trainer: Any = MISSING
    logger: Any = MISSING
    eval: Any = MISSING
    seed: int = 0  # in [0, 2**32)
    recipe_name: Optional[str] = None
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)


# (group, schema name, dataclass): every config group option names one of these in its defaults list
GROUP_SCHEMAS = [
    ("data", "data", DataConfig), ("embedder", "sentence", EmbedderConfig), ("clusterer", "kmeans", KMeansConfig),
    ("clusterer", "hierarchical", HierarchicalConfig),
    ("sampler", "random", RandomConfig), ("sampler", "uniform", UniformConfig), ("sampler", "clusterclip", ClusterClipConfig),
    ("sampler", "dynamic", DynamicConfig), ("sampler", "cluster_dp", ClusterDPConfig),
    ("model", "tiny_gpt", TinyGPTConfig), ("model", "hf_causal_lm", HFCausalLMConfig),
    ("trainer", "trainer", TrainerConfig), ("logger", "logger", LoggerConfig), ("eval", "eval", EvalConfig),
]


def schema_for(group: str, target: Any) -> type | None:
    """The schema of a composed ``group`` node: the one whose ``_target_`` default is ``target``, else
    the group's schema without a fixed target (e.g. ``random`` and ``uniform`` share SamplerConfig)."""
    import dataclasses

    def default_target(cls: type) -> Any:
        f = {x.name: x for x in dataclasses.fields(cls)}.get("_target_")
        return None if f is None else f.default

    options = [cls for g, _, cls in GROUP_SCHEMAS if g == group]
    exact = [cls for cls in options if default_target(cls) == target]
    generic = [cls for cls in options if default_target(cls) in (MISSING, None)]
    return (exact or generic or [None])[0]


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    for group, name, node in GROUP_SCHEMAS:  # root-level names, so `--help` lists only the real groups
        cs.store(name=f"schema_{group}_{name}", node=node)
