"""Config schemas (dataclasses) registered in Hydra's ConfigStore: the one place where every setting,
its default and its range are written.

Every config group option lists its schema first in its defaults list (``/schema_<group>_<name>``),
so a misspelt key or a wrong type fails at compose time naming the key; the YAML options under
``ccexp/conf/`` set only what differs from the schema. A field's lower bound sits next to it
(``ge(low, default)``) and `ccexp.preflight.preflight` checks it before any work; values that
only a component can judge (a sampler's options, a clusterer's levels) are checked by its
constructor, which pre-flight calls on a stand-in.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ccexp.errors import CcexpError


def ge(low: float, default: Any = MISSING, *, setting: bool = False, **kw) -> Any:
    """A field whose value must be ``>= low`` (None passes for Optional fields), checked by pre-flight;
    ``setting``: as [`setting`][ccexp.config.setting]."""
    return field(default=default, metadata={"min": low, "setting": setting}, **kw)


def setting(default: Any = MISSING, **kw) -> Any:
    """A field that an option carries for ccexp (its name, the level a sampler balances at, the tokenizer of a
    model), not a keyword argument of its ``_target_``: `ccexp.build.build` leaves it out."""
    if "default_factory" in kw:
        return field(metadata={"setting": True}, **kw)
    return field(default=default, metadata={"setting": True}, **kw)


def settings_of(schema: type | None) -> set[str]:
    """The fields of ``schema`` (a dataclass, or None) declared with [`setting`][ccexp.config.setting] (or ``ge(setting=True)``)."""
    import dataclasses

    if schema is None:
        return set()
    return {f.name for f in dataclasses.fields(schema) if f.metadata.get("setting")}


@dataclass
class PathsConfig:
    outputs: str = "outputs"  # Hydra runs, the stage cache and the MLflow store live here
    # the stage cache (corpus, embeddings, clusterings, tokens): reused by every run whose inputs match
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
OmegaConf.register_new_resolver("ccexp.percent", lambda total, pct, floor=0: max(int(floor), int(int(total) * float(pct) / 100)),
                                replace=True)  # ${ccexp.percent:TOTAL,PCT[,FLOOR]}
OmegaConf.register_new_resolver(  # GPUs a launcher asks for per node: the devices on a GPU trainer, else 0
    "ccexp.gpus_per_node", lambda devices, accelerator: world_size(devices, 1, str(accelerator))
    if str(accelerator) in ("gpu", "cuda") else 0, replace=True)
# ${ccexp.world_size:${trainer.devices},${trainer.num_nodes},${trainer.accelerator}}: CluSTER's K = world size
OmegaConf.register_new_resolver(
    "ccexp.world_size", lambda devices, num_nodes, accelerator: world_size(devices, int(num_nodes), str(accelerator)),
    replace=True)
def run_id() -> str:
    """The run folder's name, shared by every rank of one launch: ``slurm-<job>.<step>`` under srun with
    several tasks, ``torchrun-<run id>-<port>`` under torchrun, else ``<HH-MM-SS>-<pid>`` (runs started
    in the same second never share a folder)."""
    import time

    env = os.environ
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    if int(env.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}-{env.get('MASTER_PORT', '0')}"
    return f"{time.strftime('%H-%M-%S')}-{os.getpid()}"


def rank_log_file(name: str) -> str:
    """This process's log file in the run folder: ``<name>.log`` on rank 0 (and outside a launch),
    ``<name>-rank<r>.log`` on rank r of a torchrun/srun launch: every rank of a launch shares the run
    folder, and lines appended to one file from several nodes interleave (on NFS they can be lost)."""
    from ccexp.embedding.shards import launch_rank

    rank = launch_rank()[0]
    return f"{name}.log" if rank == 0 else f"{name}-rank{rank}.log"


def hydra_subdir() -> str | None:
    """Hydra's copy of the config (``.hydra/``) in the run folder, written by rank 0 only: the other ranks
    of a torchrun/srun launch run the same command and would rewrite the same files (None: not written)."""
    from ccexp.embedding.shards import launch_rank

    return ".hydra" if launch_rank()[0] == 0 else None


_SWEEP_ID: list[str] = []


def sweep_id() -> str:
    """The sweep folder's name (``<YYYY-MM-DD>/<HH-MM-SS>-<pid>`` of the launching process): kept in
    ``CCEXP_SWEEP_ID`` by the sweep callback so jobs in other processes (submitit, Slurm) file their
    outputs under the same sweep folder."""
    import time

    if "CCEXP_SWEEP_ID" in os.environ:
        return os.environ["CCEXP_SWEEP_ID"]
    if not _SWEEP_ID:
        _SWEEP_ID.append(f"{time.strftime('%Y-%m-%d')}/{time.strftime('%H-%M-%S')}-{os.getpid()}")
    return _SWEEP_ID[0]


def job_dir(sampler: str, seed: Any, overrides: str) -> str:
    """A sweep job's folder name, ``<sampler>-s<seed>-<6 hex digits of its sorted overrides>``: the same job
    lands in the same folder however the sweep's jobs are ordered or extended (a later launch into the
    same sweep folder finds it), and jobs that differ in any override never share one."""
    import hashlib
    import re

    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(sampler))[:60]
    return f"{name}-s{seed}-{hashlib.sha256(str(overrides).encode()).hexdigest()[:6]}"


OmegaConf.register_new_resolver("ccexp.run_id", run_id, use_cache=True, replace=True)
OmegaConf.register_new_resolver("ccexp.log_file", rank_log_file, replace=True)
OmegaConf.register_new_resolver("ccexp.hydra_subdir", hydra_subdir, replace=True)
OmegaConf.register_new_resolver("ccexp.job_dir", job_dir, replace=True)
OmegaConf.register_new_resolver("ccexp.sweep_id", sweep_id, replace=True)
GRAD_ACCUMULATION = ("${ccexp.grad_accumulation:${train.tokens_per_step},${train.seq_len},${train.micro_batch_size},"
                     "${trainer.devices},${trainer.num_nodes},${trainer.accelerator}}")


@dataclass
class TrainConfig:
    steps: int = ge(1, 400)  # optimizer steps (derived from passes when that is set)
    # the budget as passes over the training tokens: steps = ceil(passes x tokens / tokens_per_step)
    passes: Optional[float] = None
    max_steps: Optional[int] = ge(1, None)  # with passes: at most this many steps (a bounded first look at any corpus size)
    init_seed: int = "${seed}"  # type: ignore[assignment]  # the model's initialisation (and dropout)
    tokens_per_step: int = ge(1, 2048)  # target tokens per optimizer step, all ranks together (a multiple of seq_len)
    micro_batch_size: int = ge(1, 16)  # rows of seq_len tokens per forward pass per rank: what sets peak memory
    # derived: micro-batches per optimizer step per rank = tokens_per_step / (seq_len · micro_batch_size · world size)
    grad_accumulation: int = GRAD_ACCUMULATION  # type: ignore[assignment]
    seq_len: int = ge(2, 128)  # input tokens per row
    max_doc_tokens: Optional[int] = ge(1, None)  # cap on the tokens taken from one document (cut tokens are counted)
    document_mask: bool = False  # attend only within each document (per-document position ids)
    on_nonfinite: str = "stop"  # stop | skip_batch: what a NaN/inf training loss does (a bad gradient always stops)
    lr: float = 2e-3  # peak learning rate (AdamW; linear warm-up, cosine decay)
    weight_decay: float = 0.1  # AdamW weight decay
    warmup_steps: int = ge(0, 20)  # steps of linear learning-rate warm-up
    log_every_n_steps: int = ge(1, 10)  # steps between training progress lines and logged losses
    # null: a single run of a configuration that finished does nothing, one that stopped continues (docs/using.md,
    # "Stopping and continuing"); "fresh": from step 0 always; "last": the newest checkpoint of an unfinished run of
    # this configuration (an error if none); "auto": the same, or a fresh start (jobs that may be requeued); a path
    resume_from: Optional[str] = None
    checkpoint_every_n_steps: Optional[int] = ge(1, None)  # also keep checkpoints/step-N.ckpt every N steps
    record_batches: bool = False  # save each rank's trained documents per step to <run>/batches/
    # write the final weights to <run>/model as a Hugging Face folder (safetensors and the tokenizer; under FSDP
    # streamed from the sharded checkpoint, never gathered in memory); lm-eval under FSDP writes it anyway
    save_model: bool = False


@dataclass
class DataConfig:
    _target_: str = "ccexp.data.corpus.CorpusReader"
    name: str = setting()  # the data option's name (builtin, jsonl, parquet, hf_disk, sources)
    path: str = MISSING  # a .jsonl(.gz) / .parquet file, a datasets folder (save_to_disk), or "builtin"
    format: str = "auto"  # auto | jsonl | parquet | hf_disk
    split: str = "train"  # the split of a datasets folder holding a DatasetDict
    text_field: str = "text"  # the field holding each document's text
    # the field holding each document's id (null: the row number); the held-out split hashes it
    id_field: Optional[str] = "id"
    # fields reported per value (held-out ppl and exposure per domain, ...); set it for your corpus
    label_fields: list[str] = field(default_factory=list)
    # data=sources: several corpora read as one, [{path: web.jsonl, weight: 0.7, name: web}, ...]; each document is
    # labelled `source`; weight (optional, all or none): the target share of training tokens each source gets
    sources: list = setting(default_factory=list)
    drop_empty: bool = True  # skip documents whose text is empty (counted in a warning)
    # a hash-chosen subsample of this many documents of the corpus (all data.sources together); null = all
    max_documents: Optional[int] = ge(1, None)
    heldout_fraction: float = setting(0.05)  # in (0, 1): documents held out by a hash of their id
    # a field of label_fields: each of its values gets at least heldout_min_per_value held-out documents (at most
    # half of its documents), so a rare value's held-out perplexity rests on more than a handful; auto = the first of
    # label_fields, only when the hash split holds out no document of one of its values; null = off
    heldout_stratify: Optional[str] = setting("auto")
    heldout_min_per_value: int = ge(0, 20, setting=True)  # with heldout_stratify: the least held-out documents per label value
    shard_documents: int = ge(1, 100_000, setting=True)  # documents per corpus shard: the unit of reading, tokenizing and resume
    # instruction data: text_field is the prompt, this field the response; only response tokens are trained on
    response_field: Optional[str] = None


class Embedder:
    """What an embedder option declares about itself (its schema's class attributes and methods)."""

    # run-time inputs: "pretrained" (the causal LM folder its constructor takes), "prompt_chars" (its embed()
    # takes each document's prompt length in characters: instruction data)
    needs: ClassVar[frozenset] = frozenset()

    @classmethod
    def uses_run_model(cls, node: Any) -> bool:
        """True when it embeds with the run's own ``model.pretrained`` (``embedder.model=model``)."""
        return False


@dataclass
class EmbedderConfig(Embedder):
    _target_: str = "ccexp.embedding.sentence.SentenceEmbedder"
    name: str = setting()  # the embedder option's name
    model: str = MISSING  # minilm (the packaged all-MiniLM-L6-v2) or a local sentence-transformers folder
    batch_size: int = ge(1, 64)  # documents per forward pass
    max_seq_length: int = ge(1, 256)  # tokens embedded per document (see long_documents)
    device: str = "auto"  # auto (CUDA when visible) | cpu | cuda
    # auto | bfloat16 | float32: the matmuls' precision (autocast); auto = bfloat16 where the device computes it
    # natively (a GPU, a CPU with AVX512-BF16/AMX: 1.9x faster, embeddings within a cosine of 1e-4), else float32
    dtype: str = "auto"
    shard_size: int = ge(1, 2048)  # documents per shard: the unit of progress, resume and rank assignment
    long_documents: str = "truncate"  # truncate | chunk_mean: documents longer than max_seq_length tokens
    trust_remote_code: bool = False  # run the model folder's own code (e.g. jina-embeddings-v2's ALiBi BERT)
    prompt: Optional[str] = None  # text put before every document (e.g. "passage: " for E5-style models)
    pooling: Optional[str] = None  # override the folder's pooling: mean | cls | max | lasttoken; null = as saved


@dataclass
class GradientProxyConfig(Embedder):
    needs: ClassVar[frozenset] = frozenset({"pretrained", "prompt_chars"})
    _target_: str = "ccexp.embedding.gradient.GradientProxyEmbedder"
    name: str = setting()  # the embedder option's name
    model: str = "model"  # "model" = the run's own model.pretrained; or a local HF folder
    batch_size: int = ge(1, 16)  # documents per forward and backward pass
    max_seq_length: int = ge(2, 512)  # tokens read per document (prompt + response)
    device: str = "auto"  # auto (CUDA when visible) | cpu | cuda
    shard_size: int = ge(1, 256)  # smaller than the sentence embedder's: a causal LM embeds far fewer docs/s
    dtype: str = "float32"  # float32 | bfloat16 | float16 while embedding

    @classmethod
    def uses_run_model(cls, node: Any) -> bool:
        return node.model == "model"


class Clusterer:
    """What a clusterer option declares about itself (its schema's class methods; the pre-flight, the run's
    name and the reports ask these instead of looking at which keys the option has)."""

    # run-time inputs its fit() takes besides the embeddings and the training mask: "label_values"
    # (the corpus's label fields -> one value per document)
    needs: ClassVar[frozenset] = frozenset()

    @classmethod
    def cluster_counts(cls, node: Any) -> list[int] | None:
        """Clusters per level, finest first; None when the corpus decides (groups from a label)."""
        return [int(node.k)]

    @classmethod
    def count_key(cls, node: Any) -> str:
        """The setting that gives the finest level's number of clusters (for messages)."""
        return "clusterer.k"

    @classmethod
    def group_field(cls, node: Any) -> str | None:
        """The field of ``data.label_fields`` whose values are the groups; None for embedding clusters."""
        return None

    @classmethod
    def partition_seed(cls, node: Any) -> int | None:
        """The seed its partition is drawn with (None: the partition is not random)."""
        return int(node.seed)

    @classmethod
    def name_part(cls, node: Any, level: int) -> str:
        """The run name's part for the groups a sampler balances at ``level``: ``k<K>[l<level>]``."""
        return f"k{cls.cluster_counts(node)[level]}" + (f"l{level}" if level else "")


@dataclass
class KMeansConfig(Clusterer):
    _target_: str = "ccexp.clustering.kmeans.FaissKMeans"
    name: str = setting("kmeans")  # the clusterer option's name
    k: int = ge(1, 32)  # clusters K (the units the samplers balance)
    niter: int = ge(1, 20)  # k-means iterations (FAISS)
    seed: int = 0  # the partition's seed: fixed, not ${seed}, so every seed of a sweep shares one clustering
    max_points_per_centroid: int = ge(1, 256)  # k-means trains on at most K x this many points (a random subsample)
    spherical: bool = True  # normalise centroids (cosine k-means, as for sentence embeddings)
    nredo: int = 1  # k-means restarts; the lowest objective is kept
    assign_batch: int = 65536  # documents assigned to centroids per batch (bounds memory)
    device: str = "auto"  # auto (GPU when FAISS has one) | cpu | gpu
    verbose: bool = False  # FAISS's own k-means progress
    # CluSTER's size cap: no cluster holds more than ceil((1+ε) N/K) training documents; null = no cap
    size_cap_epsilon: Optional[float] = ge(0, None)


@dataclass
class HierarchicalConfig(Clusterer):
    _target_: str = "ccexp.clustering.hierarchical.HierarchicalKMeans"
    name: str = setting("hierarchical")  # the clusterer option's name
    levels: list[int] = field(default_factory=lambda: [128, 32, 8])  # finest first
    niter: int = ge(1, 20)  # k-means iterations per level (FAISS)
    seed: int = 0  # the partition's seed (fixed; see KMeansConfig.seed)
    resampling_steps: Any = 0  # per level, or one value
    sample_size: Any = 10  # points per cluster in a resampling step, per level or one value
    sampling: str = "closest"  # closest | random
    max_points_per_centroid: int = ge(1, 256)  # k-means trains on at most K x this many points (a random subsample)
    spherical: bool = True  # normalise centroids (cosine k-means)
    assign_batch: int = 65536  # documents assigned to centroids per batch (bounds memory)
    device: str = "auto"  # auto (GPU when FAISS has one) | cpu | gpu
    verbose: bool = False  # FAISS's own k-means progress

    @classmethod
    def cluster_counts(cls, node: Any) -> list[int]:
        return [int(x) for x in node.levels]

    @classmethod
    def count_key(cls, node: Any) -> str:
        return "clusterer.levels"


@dataclass
class TwoLevelConfig(Clusterer):
    _target_: str = "ccexp.clustering.two_level.TwoLevelKMeans"
    name: str = setting("two_level")  # the clusterer option's name
    k: int = ge(1, 1024)  # fine clusters
    coarse_k: Optional[int] = ge(1, None)  # coarse cells; null = round(sqrt(k))
    niter: int = ge(1, 20)  # k-means iterations per level (FAISS)
    seed: int = 0  # the partition's seed (fixed; see KMeansConfig.seed)
    max_points_per_centroid: int = ge(1, 256)  # k-means trains on at most K x this many points (a random subsample)
    spherical: bool = True  # normalise centroids (cosine k-means)
    nprobe: int = ge(1, 3)  # coarse cells searched per document when assigning (coarse_k: exact)
    assign_batch: int = 65536  # documents assigned to centroids per batch (bounds memory)
    device: str = "auto"  # auto (GPU when FAISS has one) | cpu | gpu
    verbose: bool = False  # FAISS's own k-means progress

    @classmethod
    def cluster_counts(cls, node: Any) -> list[int]:
        """The fine clusters, then the coarse cells (the constructor checks ``coarse_k`` and ``nprobe``)."""
        from ccexp.clustering.two_level import TwoLevelKMeans

        return [int(node.k), TwoLevelKMeans(k=int(node.k), coarse_k=node.coarse_k, nprobe=int(node.nprobe)).coarse_k]


@dataclass
class LabelGroupsConfig(Clusterer):
    needs: ClassVar[frozenset] = frozenset({"label_values"})  # the groups are a label field's values
    _target_: str = "ccexp.clustering.labels.LabelGroups"
    name: str = setting("labels")  # the clusterer option's name
    label_field: str = "domain"  # a field of data.label_fields: its values are the groups

    @classmethod
    def cluster_counts(cls, node: Any) -> None:
        return None

    @classmethod
    def count_key(cls, node: Any) -> str:
        return "clusterer.label_field"

    @classmethod
    def group_field(cls, node: Any) -> str:
        return str(node.label_field)

    @classmethod
    def partition_seed(cls, node: Any) -> None:
        return None

    @classmethod
    def name_part(cls, node: Any, level: int) -> str:
        return f"by-{node.label_field}"


@dataclass
class SelectionConfig:
    """Balanced selection (Vo et al. 2024 §3.2): keep ``target`` training documents, water-filled over
    the clustering's levels from the coarsest down ([`ccexp.clustering.selection`][ccexp.clustering.selection]); null = keep all."""

    target: Optional[int] = ge(1, None)  # training documents to keep; null = all
    strategy: str = "random"  # random | closest (to the finest centroid)
    seed: int = 0  # ties and random picks: part of the setup (fixed), not of a run's seed


@dataclass
class DedupConfig:
    """Semantic deduplication inside the finest clusters (SemDeDup, Abbas et al. 2023;
    [`ccexp.clustering.dedup`][ccexp.clustering.dedup]), a cached curation step before the sampler; off unless ``enabled``."""

    enabled: bool = False  # remove near-duplicate training documents before sampling
    threshold: float = 0.95  # cosine similarity in (0, 1] above which two training documents are near-duplicates
    keep: str = "hard"  # hard (farthest from the centroid survives, SemDeDup's default) | easy | random
    examples: int = ge(0, 20)  # example pairs (removed document, the one it duplicates) in the report
    seed: int = 0  # keep=random's choice: part of the setup (fixed), not of a run's seed


@dataclass
class CurateConfig:
    dedup: DedupConfig = field(default_factory=DedupConfig)


@dataclass
class SamplerConfig:
    """A sampler option; also what every sampler declares about itself (class attributes and methods)."""

    # the run-time inputs its constructor takes besides the shared ones (labels, sizes, block_size,
    # document_tokens, token_budget): "similarity" (float32[N], cosine to the centroid), "cluster_names" (the K
    # clusters' names, None when the clustering has none)
    needs: ClassVar[frozenset] = frozenset()
    _target_: str = MISSING
    name: str = setting()  # the sampler option's name
    level: int = setting(0)  # the clustering level to balance at (hierarchical clusterers; 0 = finest)
    seed: int = "${seed}"  # type: ignore[assignment]  # the data order: which documents, in which order

    @classmethod
    def prior_run(cls, node: Any) -> str | None:
        """The model the run trains before this sampler can be built: ``"reference"`` (DoReMi's reference
        losses, `ccexp.training.reference.reference_losses`), ``"proxy"`` (DoReMi's proxy run that
        learns the mixture, `ccexp.training.reference.proxy_weights`), or None."""
        return None

    @classmethod
    def stand_in(cls, node: Any, k: int) -> dict:
        """The options that replace what a prior run computes, when the sampler is built on a stand-in of
        ``k`` clusters (pre-flight; the budget check before the embedding)."""
        return {}

    @classmethod
    def check_inputs(cls, node: Any) -> None:
        """Read the files the sampler's settings name, before any stage (one line for a file it cannot use)."""

    @classmethod
    def input_files(cls, node: Any) -> list:
        """The files the sampler's settings name and its stream depends on (weights, reference losses): their
        bytes are part of a run's identity (`ccexp.names.run_identity`)."""
        return []


@dataclass
class RandomConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.RandomSampler"


@dataclass
class UniformConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.UniformSampler"


@dataclass
class TemperatureConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.TemperatureSampler"
    alpha: float = 0.5  # π_c ∝ n_c^α: 1 = random's cluster mix, 0 = uniform over clusters


@dataclass
class UniMaxConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.UniMaxSampler"
    max_epochs: int = 4  # E: no document is drawn more than E times; the rest of the budget goes to larger clusters
    on_exhausted: str = "error"  # error | reset


@dataclass
class MixtureConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.MixtureSampler"
    needs: ClassVar[frozenset] = frozenset({"cluster_names"})  # a mapping's keys may be the clusters' names
    # one per cluster: [w0, w1, ...], {cluster: w}, a .csv / .json file, an earlier run's folder, or "doremi": learn
    # them first with DoReMi's proxy run (Xie et al. 2023: dynamic rule=doremi for proxy_steps, its average weights)
    weights: Any = MISSING
    weight_unit: str = "tokens"  # tokens: each weight is the cluster's share of the training tokens | documents: of the draws
    max_repetitions: Optional[int] = ge(1, None)  # no document drawn more often (the rest re-mixed, see policies.md); null = no cap
    on_exhausted: str = "error"  # error | reset: what a cap that exhausts every weighted cluster does
    proxy_steps: int = ge(1, "${train.steps}", setting=True)  # weights=doremi: optimizer steps of the proxy run

    @classmethod
    def prior_run(cls, node: Any) -> str | None:
        return "proxy" if node.weights == "doremi" else None

    @classmethod
    def stand_in(cls, node: Any, k: int) -> dict:
        return {"weights": [1.0] * k} if cls.prior_run(node) else {}

    @classmethod
    def input_files(cls, node: Any) -> list:
        from ccexp.sampling.mixture import input_files

        return input_files(node.weights)


@dataclass
class ClusterClipConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.ClusterClipSampler"
    clip_threshold: int = 5  # M: a document drawn M times is clipped (no longer drawn) (Shao et al. 2024, Alg. 1)
    after_clip: str = "uniform"  # uniform | proportional
    on_exhausted: str = "error"  # error | reset


@dataclass
class DynamicConfig(SamplerConfig):
    _target_: str = "ccexp.sampling.DynamicSampler"
    rule: str = "odm"  # odm | doremi
    update_every: int = 1  # optimizer steps per weight update (ODM: every step)
    warmup_steps: int = "${ccexp.percent:${train.steps},5}"  # type: ignore[assignment]  # 5 % of the run
    beta: float = 0.9  # ODM: the smoothing of each cluster's reward (its moving average), in [0, 1)
    eta: float = 1.0  # DoReMi: the step size of the exponentiated-gradient weight update, > 0
    # DoReMi: the share of the uniform distribution mixed into the weights, in [0, 1]
    epsilon: float = 1e-3
    eta_tokens: Optional[float] = 524288 / 22  # DoReMi: eta is per this many tokens per cluster (2^19 tokens / 22 domains); null: per update
    # DoReMi's per-cluster reference loss: "auto" (a reference run of reference_steps with sampler=random on the
    # same data, cached as the `reference` stage), or a list / .npy / .json file with one loss per cluster
    reference_losses: Optional[Any] = "auto"
    reference_steps: int = ge(1, "${ccexp.percent:${train.steps},20,1}", setting=True)  # 20 % of the run, at least 1 step
    reference_documents: int = ge(1, 32, setting=True)  # training documents per cluster the reference model is scored on
    clip_threshold: Optional[int] = None  # as ClusterClip's M; null = no clip
    on_exhausted: str = "error"  # error | reset: what a clip that exhausts every cluster does

    @classmethod
    def prior_run(cls, node: Any) -> str | None:
        return "reference" if node.rule == "doremi" and node.reference_losses == "auto" else None

    @classmethod
    def stand_in(cls, node: Any, k: int) -> dict:
        """DoReMi's reference losses: "auto" (a prior run's); on the one-cluster stand-in of the budget check, given
        losses too (one per real cluster: none applies to a single stand-in cluster)."""
        import numpy as np

        given = node.rule == "doremi" and node.reference_losses is not None
        return {"reference_losses": np.zeros(k)} if cls.prior_run(node) or (given and k == 1) else {}

    @classmethod
    def input_files(cls, node: Any) -> list:
        from pathlib import Path

        given = node.rule == "doremi" and isinstance(node.reference_losses, str) and not cls.prior_run(node)
        return [Path(node.reference_losses).expanduser()] if given else []

    @classmethod
    def check_inputs(cls, node: Any) -> None:
        if node.rule == "doremi" and node.reference_losses is not None and not cls.prior_run(node):
            from ccexp.sampling.dynamic import load_reference_losses

            load_reference_losses(node.reference_losses, None)  # numbers, one per cluster, whatever K is


@dataclass
class ClusterDPConfig(SamplerConfig):
    needs: ClassVar[frozenset] = frozenset({"similarity"})  # the reduction keeps the farthest/closest documents
    _target_: str = "ccexp.sampling.ClusterDPSampler"
    ratio: float = 1.0  # CluSTER's reduction: every cluster keeps floor(smallest cluster size x ratio) documents, in (0, 1]
    keep: str = "farthest"  # farthest | closest | random
    layout: str = "blocked"  # blocked | interleaved


@dataclass
class TokenizerConfig:
    kind: str = "bpe"  # bpe (trained locally) | pretrained (from model.pretrained)
    vocab_size: int = ge(300, 4096)  # a byte-level BPE needs its 256 bytes and merges
    path: Optional[str] = None  # a local tokenizer folder to use instead; null = as kind says
    # the token put before every packed document; null = BOS if the tokenizer adds one (Llama), else EOS
    separator: Optional[str] = None


class ModelSource:
    """What a model option declares about itself: where its weights come from, and its own cross-checks."""

    @classmethod
    def weights_source(cls, node: Any) -> str | None:
        """The pretrained weights it starts from (a folder, a model id or a .gguf file); None: trained from scratch."""
        return None

    @classmethod
    def architecture_numbers(cls, node: Any) -> dict | None:
        """The architecture numbers ``python -m ccexp.plan model`` builds it from without weights (None: none given)."""
        return None

    @classmethod
    def check(cls, node: Any, longest: int) -> None:
        """Raise CcexpError if it cannot take rows of ``longest`` tokens or its settings disagree."""


@dataclass
class TinyGPTConfig(ModelSource):
    _target_: str = "ccexp.training.models.tiny_gpt"
    name: str = setting("tiny_gpt")  # the model option's name
    n_layer: int = 2  # transformer blocks
    n_embd: int = 128  # model width
    n_head: int = 4  # attention heads (n_embd must divide by it)
    n_positions: int = 512  # the longest position the model has (>= train.seq_len and eval.max_tokens)
    dropout: float = 0.0  # dropout probability during training
    tokenizer: TokenizerConfig = setting(default_factory=TokenizerConfig)  # the tokenizer (below)

    @classmethod
    def check(cls, node: Any, longest: int) -> None:
        if node.n_head < 1 or node.n_embd % node.n_head:
            raise CcexpError(f"model.n_embd={node.n_embd} must be divisible by model.n_head={node.n_head}")
        if node.n_positions < longest:
            raise CcexpError(f"model.n_positions={node.n_positions} is shorter than train.seq_len / eval.max_tokens "
                             f"({longest}); raise model.n_positions")


@dataclass
class HFCausalLMConfig(ModelSource):
    _target_: str = "ccexp.training.models.hf_causal_lm"
    name: str = setting()  # the model option's name
    pretrained: str = MISSING  # a local Hugging Face model folder or a .gguf file (converted once)
    dtype: str = "float32"  # float32 | bfloat16 | float16: the weights' dtype
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory, more time)
    tokenizer: TokenizerConfig = setting(default_factory=lambda: TokenizerConfig(kind="pretrained", path=None))  # the tokenizer (below): the model folder's own by default
    # the numbers of the model's config.json (model_type, hidden_size, ...): python -m ccexp.plan builds the
    # model from them on the meta device without the weights; null = read config.json from model.pretrained
    architecture: Optional[dict] = setting(None)

    @classmethod
    def weights_source(cls, node: Any) -> str:
        return str(node.pretrained)

    @classmethod
    def architecture_numbers(cls, node: Any) -> dict | None:
        from omegaconf import OmegaConf

        return None if node.architecture is None else OmegaConf.to_container(node.architecture, resolve=True)

    @classmethod
    def check(cls, node: Any, longest: int) -> None:
        from ccexp.model_source import require_local_model

        require_local_model(node.pretrained, "model.pretrained", causal_lm=True,
                            tokenizer=node.tokenizer.kind == "pretrained" and not node.tokenizer.path)


@dataclass
class FSDPConfig:
    """``trainer.strategy=fsdp`` (`ccexp.training.distributed`)."""

    auto_wrap: Optional[str] = "decoder_layer"  # decoder_layer (the model's _no_split_modules) | null (one unit)
    activation_checkpointing: bool = True  # recompute each decoder layer's activations in the backward pass
    sharding_strategy: str = "FULL_SHARD"  # FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD
    state_dict_type: str = "sharded"  # sharded (each rank writes its shard) | full
    cpu_offload: bool = False  # keep parameters on the CPU between uses (for models larger than the GPUs)
    load_weights: str = "rank0"  # rank0 (read once, other ranks on the meta device, broadcast) | every_rank


@dataclass
class TrainerConfig:
    _target_: str = "lightning.pytorch.Trainer"
    name: str = setting()  # the trainer option's name (cpu, gpu, ddp, fsdp)
    accelerator: str = "cpu"  # Lightning's accelerator: cpu | gpu | auto
    devices: Any = 1  # devices per node: a count, -1 (all), auto or a list of ids
    num_nodes: int = ge(1, 1)  # nodes (multi-node runs under a launcher such as Slurm or torchrun)
    strategy: str = "auto"  # auto | ddp | ddp_spawn | fsdp
    precision: str = "32-true"  # Lightning's precision: 32-true | bf16-mixed | 16-mixed | bf16-true
    gradient_clip_val: Optional[float] = 1.0  # clip the gradient norm to this; null = off
    threads: Optional[int] = ge(1, None, setting=True)  # torch.set_num_threads (and OMP_NUM_THREADS), on any accelerator; None = torch's default
    enable_progress_bar: bool = True  # Lightning's live bar (ccexp's progress lines are logged either way)
    fsdp: FSDPConfig = setting(default_factory=FSDPConfig)  # used when strategy=fsdp
    profiler: Optional[Any] = None  # Lightning's profiler: simple | advanced | a mapping with _target_ (debug=profiler); null = off


@dataclass
class LoggerConfig:
    name: str = MISSING  # the logger option's name
    enabled: bool = True  # log to MLflow (false: files only)
    tracking_uri: Optional[str] = None  # default sqlite:///<paths.outputs>/mlflow.db
    artifact_location: Optional[str] = None  # default <paths.outputs>/mlartifacts
    experiment: str = "ccexp"  # the MLflow experiment the runs go to
    # more Lightning loggers trained beside MLflow: name -> mapping with _target_ (logger=tensorboard); {} = none
    loggers: dict = field(default_factory=dict)


@dataclass
class LmEvalConfig:
    local_tasks: bool = True  # per-label perplexity + a continuation multiple-choice task from held-out docs
    label_field: str = "domain"  # one perplexity task per value of this label (if the corpus has it)
    tasks: list[str] = field(default_factory=list)  # standard lm-eval tasks (cached locally), or tasks of include_path
    include_path: Optional[str] = None  # a folder of your own lm-eval task YAMLs (lm-eval's --include_path)
    limit: Optional[int] = None  # documents per task
    batch_size: int = 16  # lm-eval's batch size
    max_docs_per_task: int = 100  # documents scored per task (a fixed subset: the same for every run)
    mc_docs: int = 200  # questions in the held-out multiple-choice task (documents of at least 40 characters)
    seed: int = 0  # the documents each task samples and lm-eval's own seeds: fixed, so every run is scored alike


@dataclass
class EvalConfig:
    name: str = MISSING  # the eval option's name
    # tokens scored per held-out document: by default the training rows' length, so no scored token sits at a
    # position the model never trained (a model trained from scratch on rows of seq_len has seen no later one)
    max_tokens: int = ge(1, "${train.seq_len}")
    batch_size: int = ge(1, 32)  # held-out documents scored per batch
    max_cluster_metrics: int = ge(0, 256)  # per-cluster metrics go to MLflow when K <= this (CSV always)
    min_cluster_docs: int = ge(1, 5)  # ppl_worst considers clusters with at least this many held-out documents
    every_n_steps: Optional[int] = ge(1, 100)  # score a fixed held-out sample every N optimizer steps (curve/*); null = off
    curve_documents: int = ge(1, 128)  # size of that sample (the same documents for every run of a corpus)
    balance_report: bool = True  # plots + Markdown of the corpus vs trained cluster mix
    # the weights the headline held-out metrics (eval/*) are scored on: none (the final weights), ema (an
    # exponential moving average with a time constant of average_span of the run) or tail (the uniform mean over
    # the last average_span of the steps); with ema/tail the final weights are scored too (eval/final/*).
    # none by default: measured in docs/studies/decisive/averaging.md, no average cut the seed-to-seed noise
    average: str = "none"
    average_span: float = 0.1  # in (0, 1]: the fraction of the run the average covers
    lm_eval: Optional[LmEvalConfig] = None  # downstream tasks with lm-eval (eval=lm_eval); null = off


@dataclass
class PlanConfig:
    """``python -m ccexp.plan``: a policy's token stream without a model (`ccexp.data.simulate`)."""

    source: str = "corpus"  # corpus (this config's own cached stages) | synthetic (the numbers below)
    clusters: int = ge(1, 10000)  # synthetic: K
    documents: int = ge(1, 1_000_000)  # synthetic: N
    zipf: float = ge(0, 1.0)  # synthetic: n_c ∝ c^-zipf (0: equal sizes)
    mean_tokens: float = ge(1, 500.0)  # synthetic: mean document length (log-normal), tokens
    sigma: float = ge(0, 1.0)  # synthetic: log-space spread of the lengths (0: every document mean_tokens long)
    record_every: int = ge(1, 100)  # steps between points of the mix-over-time curves (at most steps/20)


@dataclass
class ReportConfig:
    """How a sweep's runs are compared (`ccexp.compare.report`, [`ccexp.compare.verdict`][ccexp.compare.verdict])."""

    baseline: str = "random"  # the sampler every other is paired with, seed by seed
    # the question the verdict decides (held-out bits per byte); every other metric is exploratory. A sweep records
    # it, with baseline, min_effect, power, seeds and budget, on its parent run before its first job
    primary: str = "eval/bpb"
    min_effect: float = 0.02  # the smallest difference that matters, as a share of the baseline's mean
    power: float = 0.8  # the power the "seeds needed" should give (two-sided paired t-test at alpha 0.05)
    # skip, before any training, a sweep job whose token stream would be identical to an earlier job's
    skip_duplicates: bool = True


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
    recipe_name: Optional[str] = None  # the recipe a run was made from (set by +recipe=...)
    recipe_note: Optional[str] = None  # what a recipe is for, said at the start of every run it makes
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    curate: CurateConfig = field(default_factory=CurateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    # Lightning callbacks added to the run's own: name -> mapping with _target_ (callbacks=[lr_monitor,device_stats])
    callbacks: dict = field(default_factory=dict)


# (group, schema name, dataclass): every config group option names one of these in its defaults list
GROUP_SCHEMAS = [
    ("data", "data", DataConfig), ("embedder", "sentence", EmbedderConfig),
    ("embedder", "gradient_proxy", GradientProxyConfig), ("clusterer", "kmeans", KMeansConfig),
    ("clusterer", "hierarchical", HierarchicalConfig), ("clusterer", "two_level", TwoLevelConfig),
    ("clusterer", "labels", LabelGroupsConfig),
    ("sampler", "random", RandomConfig), ("sampler", "uniform", UniformConfig), ("sampler", "clusterclip", ClusterClipConfig),
    ("sampler", "temperature", TemperatureConfig), ("sampler", "unimax", UniMaxConfig),
    ("sampler", "mixture", MixtureConfig),
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


def child_schema(schema: type, key: str, node: Any) -> type | None:
    """The schema of ``schema``'s field ``key`` whose composed value is ``node``: for a config group of the
    root (``sampler``, ``model``, ...) the one registered for its ``_target_`` ([`schema_for`][ccexp.config.schema_for]), else the
    dataclass the field is annotated with (``Optional`` unwrapped); None for a field of plain values."""
    import dataclasses
    import typing

    if schema is RootConfig and key in {group for group, _, _ in GROUP_SCHEMAS}:
        return schema_for(key, node.get("_target_"))
    hint = typing.get_type_hints(schema).get(key)
    return next((t for t in (hint, *typing.get_args(hint)) if isinstance(t, type) and dataclasses.is_dataclass(t)),
                None)


def component(group: str, node: Any) -> type:
    """The schema that declares what the ``group`` option ``node`` is ([`schema_for`][ccexp.config.schema_for] its ``_target_``);
    for a ``_target_`` no schema names, the group's declarations with their defaults."""
    defaults = {"clusterer": Clusterer, "sampler": SamplerConfig, "embedder": Embedder, "model": ModelSource}
    found = schema_for(group, node.get("_target_"))
    return found if found is not None and issubclass(found, defaults.get(group, object)) else defaults[group]


# the settings typed list[...] in the schemas above (tests/test_help.py checks that none is missing)
LIST_SETTINGS = ("data.label_fields", "clusterer.levels", "eval.lm_eval.tasks")


def one_item_lists(overrides: list[str]) -> list[str]:
    """``overrides`` with a single value given to a list setting made a one-item list, as a user means it:
    ``data.label_fields=domain`` is ``data.label_fields=[domain]`` (Hydra would refuse "str is not a
    ListConfig"), and in a sweep each choice is (``data.label_fields=domain,source`` sweeps ``[domain]`` and
    ``[source]``). Brackets, quotes, interpolations and sweep functions are left as written."""
    import re

    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.lstrip("+~") in LIST_SETTINGS and re.fullmatch(r"[\w.\-/: ]+(,[\w.\-/: ]+)*", value):
            item = f"{key}=" + ",".join(f"[{v}]" for v in value.split(","))
        out.append(item)
    return out


def compose(overrides: list[str]):
    """The shipped config (``ccexp/conf/config.yaml``) with ``overrides``, outside a running Hydra app
    (Hydra's compose API; the schemas are registered first).

    Raises:
        hydra.errors.HydraException, omegaconf.errors.OmegaConfBaseException: for a bad override.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ccexp.conf import CONFIG_DIR

    register()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        return hydra_compose("config", overrides=one_item_lists(overrides))


def register() -> None:
    import warnings

    # ccexp's hydra/launcher/joblib.yaml (and hydra/sweeper/basic.yaml: Hydra's own) takes the name of a plugin's schema on purpose (the documented
    # `hydra/launcher=joblib` runs ccexp's launcher, with the plugin's settings): Hydra's note that the file is
    # validated against that schema is not the user's to act on
    warnings.filterwarnings("ignore", message=r"\s*'hydra/(launcher/joblib|sweeper/basic)' is validated against ConfigStore schema")
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    for group, name, node in GROUP_SCHEMAS:  # root-level names, so `--help` lists only the real groups
        cs.store(name=f"schema_{group}_{name}", node=node)
