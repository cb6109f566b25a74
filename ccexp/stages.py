"""The cached preprocessing stages — corpus -> embed -> cluster, and tokenize — returning typed artifacts.

Each stage's output lives in ``<paths.cache>/<stage>/<fingerprint>/`` ([`ccexp.artifacts`][ccexp.artifacts]); a
run whose stage config and inputs are unchanged reuses it and logs ``reused=True``. Each stage
logs one line with its figures. File names stay inside this module: callers get
[`Corpus`][ccexp.data.corpus.Corpus], [`Embeddings`][ccexp.stages.Embeddings], [`Clustering`][ccexp.clustering.kmeans.Clustering]
and [`TokenizedCorpus`][ccexp.data.tokenize.TokenizedCorpus], and [`train_split`][ccexp.stages.train_split] turns them into the [`TrainSplit`][ccexp.data.split.TrainSplit] a
sampler trains on.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ccexp import stage_keys as keys
from ccexp.artifacts import StageStore
from ccexp.build import build
from ccexp.clustering.kmeans import Clustering, Level
from ccexp.data.corpus import BUILTIN_PATH, Corpus, subsample
from ccexp.data.remote import RemoteSource, local_or_url
from ccexp.data.sources import SOURCE_FIELD, source_batches, source_entries, source_names
from ccexp.data.split import TrainSplit
from ccexp.data.tokenize import TokenizedCorpus
from ccexp.errors import CcexpError
from ccexp.model_source import check_vocabulary

log = logging.getLogger("ccexp")

_LEVEL_ARRAYS = ("labels", "centroids", "sizes", "similarity", "parent")


@dataclass
class StageResult:
    """What a stage did: where its output is, its fingerprint, whether it was reused, its figures."""

    stage: str
    path: Path
    fingerprint: str
    reused: bool
    seconds: float
    figures: dict = field(default_factory=dict)


@dataclass
class Embeddings:
    """vectors: float16[N, d] L2-normalised, memory-mapped."""

    vectors: np.ndarray


class Stages:
    """The cached stages of one run. Call them in order; `results` keeps each stage's
    [`StageResult`][ccexp.stages.StageResult] (for the run's record), and later stages key on earlier ones' content.

    Args:
        store: the stage store under ``paths.cache``.
        data, embedder, clusterer, model, curate: the run's options of those groups (each stage reads
            its own: the corpus ``data``, the tokenizer ``model.tokenizer``, ...).
    """

    def __init__(self, store: StageStore, *, data: DictConfig, embedder: DictConfig, clusterer: DictConfig,
                 model: DictConfig, curate: DictConfig):
        self.store = store
        self.data, self.embedder, self.clusterer, self.model_cfg, self.curate = data, embedder, clusterer, model, curate
        self.results: dict[str, StageResult] = {}

    @classmethod
    def for_config(cls, cfg: DictConfig, store: StageStore) -> "Stages":
        """The stages of a whole composed config (scripts, benchmarks and tests; the recipe passes the parts)."""
        return cls(store, data=cfg.data, embedder=cfg.embedder, clusterer=cfg.clusterer, model=cfg.model,
                   curate=cfg.curate)

    def cached(self, stage: str, fp: str, produce, describe) -> StageResult:
        """Reuse ``<stage>/<fp>`` if done, else call ``produce(tmp_dir) -> figures`` and publish it: the
        preprocessing stages, and the training steps the recipe calls (DoReMi's prior runs), which keep
        their output here the same way (reused when done, published whole, locked against concurrent runs).
        On the other ranks of a torchrun/srun launch it waits for rank 0 to publish it: only rank 0 writes
        the stage store (a file lock shared across nodes is not to be trusted on every network file
        system), the others write only their share of a sharded stage's work files (embed, tokenize)."""
        from ccexp.embedding.shards import launch_rank

        t0 = time.perf_counter()
        reused = self.store.is_done(stage, fp)
        if not reused and launch_rank()[0] != 0:
            log.info("%s: waiting for rank 0 to publish it (fingerprint %s)", stage, fp[:6])
            self.store.wait(stage, fp)
            reused = True
        if not reused:
            with self.store.lock(stage, fp):  # another run computing it: wait, then reuse
                reused = self.store.is_done(stage, fp)
                if not reused:
                    with self.store.publish(stage, fp) as tmp:
                        figures = produce(tmp)
                        (tmp / "figures.json").write_text(json.dumps(figures, indent=2, default=str))
        path = self.store.path(stage, fp)
        figures = json.loads((path / "figures.json").read_text())
        result = StageResult(stage, path, fp, reused, time.perf_counter() - t0, figures)
        log.info("%s: %s, reused=%s, %.1f s, fingerprint %s", stage, describe(figures), reused, result.seconds, fp[:6])
        self.results[stage] = result
        return result

    # -- corpus -----------------------------------------------------------------------------------
    def corpus(self) -> Corpus:
        """Read and validate the corpus in batches and store it as Parquet shards of
        ``data.shard_documents`` documents (id, text, heldout, labels; [`ccexp.data.store`][ccexp.data.store]), the
        held-out split decided per document. No step holds the whole corpus: the returned
        [`Corpus`][ccexp.data.corpus.Corpus] reads its texts from the shards on demand.

        Raises:
            CcexpError: from the reader (missing file, bad records) or the split.
        """
        from ccexp.data.store import open_corpus, write_corpus

        d = self.data
        readers = self._readers()
        digest = "+".join(f"{name}:{digest}" if name else digest for name, _, _, digest in readers)
        batches = readers[0][1].batches if not d.sources else partial(source_batches, [
            (name, reader.batches) for name, reader, _, _ in readers])
        if d.sources and d.max_documents:  # the corpus's subsample, over all sources (each reader reads all)
            def read(warn: bool):
                return source_batches([(name, partial(reader.batches, warn=warn)) for name, reader, _, _ in readers],
                                      65536)

            batches = partial(subsample, read, int(d.max_documents))
        fp = keys.stage_fingerprint("corpus", *keys.corpus_key(d, digest))

        def produce(tmp: Path) -> dict:
            figures = {**write_corpus(
                batches(int(d.shard_documents)), tmp, heldout_fraction=d.heldout_fraction,
                label_fields=list(d.label_fields), stratify=d.heldout_stratify,
                min_per_value=int(d.heldout_min_per_value)),
                "source": ", ".join(str(src) for _, _, src, _ in readers), "label_hint": readers[0][1].label_hint}
            for _, reader, src, _ in readers:  # never cache what the key does not name
                if isinstance(reader.path, RemoteSource) and keys.object_digest(reader.path.identity()) not in digest:
                    raise CcexpError(f"{reader.path.key}={str(src)!r} changed in the object store while it was read; "
                                     "run again")
            return figures

        result = self.cached("corpus", fp, produce,
                           lambda f: f"{f['documents']:,} docs ({f['heldout']:,} held out) in {f.get('shards', 1)} "
                                     "shard(s) from " + ", ".join(Path(p).name for p in f["source"].split(", ")))
        _log_labels(result.figures)
        return open_corpus(result.path)

    def _readers(self) -> list[tuple]:
        """``(name, reader, source, digest)`` of ``data.path`` (name ``""``), or of each ``data.sources`` entry
        (reading the label fields but ``source``, which the sources give): the source a local path or a URL,
        its digest the file's bytes, or for a URL its objects' ETags / versions and sizes (asked of the store)."""
        d = self.data
        if d.sources:
            fields = [f for f in d.label_fields if f != SOURCE_FIELD]
            whole = {"label_fields": fields, "max_documents": None}  # data.max_documents: of the corpus, below
            entries = [(name, str(s["path"]), whole, f"data.sources[{i}].path")
                       for i, (name, s) in enumerate(zip(source_names(d.sources), source_entries(d.sources)))]
        else:
            entries = [("", d.path, {}, "data.path")]
        out = []
        for name, path, extra, key in entries:
            src = BUILTIN_PATH if path == "builtin" else local_or_url(path)
            src = src.resolve() if isinstance(src, Path) else src
            try:
                reader = build(d, "data", path=src, **extra)  # raises the one-line "does not exist" error
            except CcexpError as e:  # the reader's line names data.path: here it may be a source's path
                raise CcexpError(str(e).replace("data.path", key)) from None
            remote = isinstance(reader.path, RemoteSource)
            if remote:  # the store's lines (mid-read too) name this setting
                reader.path = replace(reader.path, key=key)
            out.append((name, reader, src, keys.object_digest(reader.path.identity()) if remote else self._digest(src)))
        seen: dict[str, int] = {}
        for i, (name, _, src, digest) in enumerate(out):  # one file's documents under two sources: each held out
            if digest in seen and d.sources:  # under one source's ids and trained on under the other's
                raise CcexpError(f"data.sources[{i}] ({src}) holds the same bytes as data.sources[{seen[digest]}] "
                                 f"({out[seen[digest]][2]}): its documents would be trained on twice and held out "
                                 "under one name while trained on under the other; give each file once")
            seen.setdefault(digest, i)
        return out

    def _content(self) -> str:
        return self.results["corpus"].figures["content"]

    def _labels(self) -> str | None:
        """The digest of the corpus's label values (None without labels): what the stages' reports read."""
        return self.results["corpus"].figures.get("labels")

    def _digest(self, path: str | Path) -> str:
        """[`ccexp.stage_keys.content_digest`][ccexp.stage_keys.content_digest] of a file or folder, remembered under the stage cache (by
        rank 0 of a launch: the other ranks read what it remembered)."""
        from ccexp.embedding.shards import launch_rank

        return keys.content_digest(path, self.store.root / "digests.json", record=launch_rank()[0] == 0)

    # -- embed ------------------------------------------------------------------------------------
    def embed(self, corpus: Corpus, pretrained: str | None = None) -> Embeddings:
        """Embed every document (float16[N, d], L2-normalised); ``pretrained`` is the run's model folder,
        for an embedder that embeds with the trained model (CluSTER's gradient proxy).

        Shards are written to ``<cache>/embed/.work-<fingerprint>/`` as they finish, so an interrupted
        run resumes with the unfinished shards; under torchrun/srun every rank embeds its share and
        rank 0 assembles and publishes the array.
        """
        from ccexp.embedding.shards import launch_rank

        runtime, extra, model = self._embedder_inputs(corpus, pretrained)
        fp = keys.stage_fingerprint("embed", *keys.embed_key(self.embedder, self._content(), model))
        work_dir = self.store.root / "embed" / f".work-{fp}"
        rank, world = launch_rank()

        def produce(tmp: Path) -> dict:
            t0 = time.perf_counter()
            embedder = build(self.embedder, "embedder", **runtime)
            emb, stats = embedder.embed(corpus.texts, tmp / "embeddings.npy", work_dir, rank=rank, world_size=world,
                                        **extra)
            secs = time.perf_counter() - t0
            shutil.rmtree(work_dir, ignore_errors=True)  # the array replaces the shards (only the computing run)
            return {"documents": emb.shape[0], "dim": emb.shape[1], "seconds": secs, "docs_per_s": emb.shape[0] / secs,
                    "shards": len(stats["embedded"]) + len(stats["skipped"]), "shards_resumed": len(stats["skipped"]),
                    "long_documents": stats["long_documents"], "max_seq_length": self.embedder.max_seq_length,
                    "long_documents_mode": embedder.long_documents}

        if rank != 0 and not self.store.is_done("embed", fp):  # embed this rank's shards, then wait for rank 0
            build(self.embedder, "embedder", **runtime).embed(corpus.texts, work_dir / "unused.npy", work_dir,
                                                                  rank=rank, world_size=world, **extra)
            self.store.wait("embed", fp)
        result = self.cached("embed", fp, produce, lambda f: f"{f['documents']:,} docs, dim {f['dim']}, "
                           f"{f['docs_per_s']:.0f} docs/s when computed, {f.get('shards', 1)} shards"
                           + (f" ({f['shards_resumed']} resumed)" if f.get("shards_resumed") else ""))
        long, mode = result.figures.get("long_documents", 0), result.figures.get("long_documents_mode", "truncate")
        if long and mode == "first_tokens":  # the gradient proxy reads the first tokens
            log.info("embed: %s documents are longer than embedder.max_seq_length=%d tokens; their first tokens were "
                     "read", f"{long:,}", result.figures["max_seq_length"])
        elif long and mode == "truncate":
            log.warning("embed: %s of %s documents are longer than embedder.max_seq_length=%d tokens and were "
                        "embedded from their beginning only; set embedder.long_documents=chunk_mean to embed them "
                        "whole", f"{long:,}", f"{result.figures['documents']:,}", result.figures["max_seq_length"])
        elif long:
            log.info("embed: %s long documents embedded as the mean of their %d-token windows", f"{long:,}",
                     result.figures["max_seq_length"])
        return Embeddings(np.load(result.path / "embeddings.npy", mmap_mode="r"))

    def _embedder_inputs(self, corpus: Corpus, pretrained: str | None) -> tuple[dict, dict, str | None]:
        """What the configured embedder needs besides the texts: its constructor's run-time arguments
        (the model folder of an embedder that embeds with a causal LM: the run's own when
        ``embedder.model=model``), its ``embed`` arguments (instruction boundaries), and the model its
        vectors come from, for the stage's key: the model stage's fingerprint, or the digest of the
        embedding model folder's bytes."""
        from ccexp.config import component
        from ccexp.model_source import is_gguf, resolve_pretrained

        declared = component("embedder", self.embedder)
        runtime, model = {}, None
        spec, own = self.embedder.model, declared.uses_run_model(self.embedder)
        if "pretrained" in declared.needs:
            runtime["pretrained"] = pretrained if own else resolve_pretrained(spec)
            if is_gguf(runtime["pretrained"] or ""):
                raise CcexpError(f"embedder.model={spec!r} is a GGUF file; make it the run's model.pretrained and "
                                 "set embedder.model=model (its converted folder is used)")
            model = (self.results["model"].fingerprint if "model" in self.results else
                     self.model_digest(pretrained)) if own else self.model_digest(runtime["pretrained"])
        else:
            from ccexp.embedding.sentence import resolve_model_path

            model = self._digest(resolve_model_path(spec))
        extra = {"prompt_chars": corpus.prompt_chars} if "prompt_chars" in declared.needs else {}
        return runtime, extra, model

    def model_digest(self, source: str | None) -> str | None:
        """The bytes of a local model folder, or of the cached snapshot of a Hugging Face model id."""
        if source is None:
            return None
        if Path(source).exists():
            return self._digest(source)
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(source, "config.json")
        return self._digest(Path(config).parent) if isinstance(config, str) else f"id:{source}"

    # -- cluster ----------------------------------------------------------------------------------
    def cluster(self, corpus: Corpus, embeddings: Embeddings) -> Clustering:
        """k-means on the training documents' embeddings; every level's labels for every document, and
        the cluster report (``report/``: sizes plot, nearest documents, imbalance and label agreement)."""
        fp = keys.stage_fingerprint("cluster", *keys.cluster_key(self.clusterer, self.results["embed"].fingerprint,
                                                                  self._content(), self._labels()))

        def produce(tmp: Path) -> dict:
            from ccexp.clustering.report import write_cluster_report

            clusterer = build(self.clusterer, "clusterer")
            from ccexp.config import component

            declared = component("clusterer", self.clusterer)
            extra = {"label_values": corpus.labels} if "label_values" in declared.needs else {}
            seed = declared.partition_seed(self.clusterer)
            result = clusterer.fit(embeddings.vectors, ~corpus.heldout, **extra)
            for depth, level in enumerate(result.levels):
                for name in _LEVEL_ARRAYS:
                    if getattr(level, name) is not None:
                        np.save(tmp / f"level{depth}_{name}.npy", getattr(level, name))
            finest = result.levels[0]
            report = write_cluster_report(tmp / "report", labels=finest.labels, sizes=finest.sizes,
                                          similarity=finest.similarity, texts=corpus.texts, label_values=corpus.labels,
                                          train_mask=~corpus.heldout,
                                          title=f"{self.data.name} / {self.clusterer.name} seed "
                                          f"{'-' if seed is None else seed}")
            return {"levels": [lv.k for lv in result.levels], "names": [lv.names for lv in result.levels],
                    "train_points": result.train_points,
                    "objective": result.objective, "largest": int(finest.sizes.max()),
                    "smallest": int(finest.sizes.min()), "empty": int((finest.sizes == 0).sum()), "report": report}

        result = self.cached("cluster", fp, produce, lambda f: f"K={'/'.join(map(str, f['levels']))}, trained on "
                           f"{f['train_points']:,} points, sizes {f['smallest']}..{f['largest']} ({f['empty']} empty)")
        names = result.figures.get("names") or [None] * len(result.figures["levels"])
        levels = [Level(**{name: np.load(p) if (p := result.path / f"level{depth}_{name}.npy").is_file() else None
                           for name in _LEVEL_ARRAYS}, names=names[depth]) for depth in range(len(result.figures["levels"]))]
        return Clustering(levels, int(result.figures["train_points"]), float(result.figures["objective"]))

    # -- dedup ------------------------------------------------------------------------------------
    def dedup(self, corpus: Corpus, embeddings: Embeddings, clustering: Clustering) -> np.ndarray | None:
        """Semantic deduplication of the training documents inside the finest clusters when
        ``curate.dedup.enabled`` ([`ccexp.clustering.dedup.semantic_dedup`][ccexp.clustering.dedup.semantic_dedup]): bool[N], False for a
        removed near-duplicate; None when off. Its report (``report/``): removals per cluster and per
        label value (CSV) and example pairs (Markdown).

        Raises:
            CcexpError: for an invalid threshold or ``keep``, or non-finite embeddings.
        """
        d = self.curate.dedup
        if not d.enabled:
            return None
        fp = keys.stage_fingerprint("dedup", *keys.dedup_key(d, self.results["cluster"].fingerprint, self._labels()))

        def produce(tmp: Path) -> dict:
            from ccexp.clustering.dedup import semantic_dedup, write_dedup_report

            finest = clustering.level(0)
            result = semantic_dedup(embeddings.vectors, finest.labels, d.threshold, mask=~corpus.heldout,
                                    centroid_similarity=finest.similarity, keep=d.keep, seed=int(d.seed))
            np.save(tmp / "kept.npy", result.kept)
            write_dedup_report(tmp / "report", result, labels=finest.labels, k=finest.k, texts=corpus.texts,
                               label_values=corpus.labels, train_mask=~corpus.heldout, examples=int(d.examples))
            searched = int((~corpus.heldout).sum())
            train = ~corpus.heldout  # a cluster keeps its first document; a label value can lose all of its
            emptied = {name: sorted(set(np.unique(v[train]).tolist()) - set(np.unique(v[train & result.kept]).tolist()))
                       for name, v in ((n, np.asarray(vs, dtype=str)) for n, vs in corpus.labels.items())}
            return {"removed": int(result.removed.size), "searched": searched, "threshold": float(d.threshold),
                    "removed_fraction": result.removed.size / max(1, searched),
                    "emptied_label_values": {f: [str(v) for v in vs] for f, vs in emptied.items() if vs}}

        result = self.cached("dedup", fp, produce, lambda f: f"{f['removed']:,} near-duplicates of {f['searched']:,} "
                           f"training docs removed ({f['removed_fraction']:.2%}) at cosine >= {f['threshold']}")
        f = result.figures
        if f["removed_fraction"] > 0.5:
            log.warning("dedup: %.0f%% of the training documents were removed as near-duplicates at cosine >= %s; "
                        "read %s before training on the rest, or raise curate.dedup.threshold",
                        100 * f["removed_fraction"], f["threshold"], result.path / "report" / "dedup_examples.md")
        for name, values in f.get("emptied_label_values", {}).items():
            log.warning("dedup: every training document of %s = %s was a near-duplicate of an earlier document of its "
                        "cluster and was removed; raise curate.dedup.threshold to keep them", name, values)
        return np.load(result.path / "kept.npy")

    def curation_report(self) -> list[Path]:
        """The dedup stage's report files ([] when it did not run)."""
        return sorted((self.results["dedup"].path / "report").glob("*")) if "dedup" in self.results else []

    def fingerprints(self) -> dict[str, str]:
        """stage -> fingerprint of the stages run so far."""
        return {name: r.fingerprint for name, r in self.results.items()}

    def cluster_report(self) -> tuple[dict[str, float], list[Path]]:
        """The cluster stage's report: its metrics (``cluster/*`` without the prefix) and files."""
        result = self.results["cluster"]
        return result.figures.get("report", {}), sorted((result.path / "report").glob("*"))

    # -- model ------------------------------------------------------------------------------------
    def model(self) -> str | None:
        """The local source of ``model.pretrained`` (None for a model trained from scratch): a folder or
        HF model id as given, or — for a GGUF file (also ``pkg:<package>/<file>.gguf``) — the Hugging
        Face folder it is converted into once (``<cache>/model/<fingerprint>/hf``, keyed by its SHA-256).

        Raises:
            CcexpError: for a missing package or file, or a GGUF file that cannot be converted.
        """
        from ccexp.model_source import convert_gguf, is_gguf, resolve_pretrained

        from ccexp.config import component

        spec = component("model", self.model_cfg).weights_source(self.model_cfg)
        if spec is None:
            return None
        path = resolve_pretrained(spec)
        if not is_gguf(path):
            return path
        fp = keys.stage_fingerprint("model", {}, {"gguf": self._digest(path)})
        result = self.cached("model", fp, lambda tmp: convert_gguf(path, tmp / "hf"),
                           lambda f: f"{f['architecture']} with {f['parameters'] / 1e6:.1f}M parameters, vocab "
                           f"{f['vocab_size']:,}, from {Path(f['source']).name}")
        return str(result.path / "hf")

    # -- tokenize ---------------------------------------------------------------------------------
    def tokenize(self, corpus: Corpus, pretrained: str | None = None) -> TokenizedCorpus:
        """Train (or load) the tokenizer and tokenize every document (``pretrained``: the model's
        local source from [`model`][ccexp.stages.Stages.model], whose tokenizer ``kind=pretrained`` uses).

        Raises:
            CcexpError: for an unknown tokenizer kind, a tokenizer that cannot be loaded, a
                ``model.tokenizer.separator`` it does not have, or one with more tokens than the pretrained model embeds
                ([`ccexp.model_source.check_vocabulary`][ccexp.model_source.check_vocabulary]).
        """
        from ccexp.data.tokenize import (assemble_tokens, check_tokenizer_kind, load_tokenizer, separator_id,
                                         tokenize_shards)
        from ccexp.embedding.shards import launch_rank, wait_for_shards

        tcfg = self.model_cfg.tokenizer
        source = tcfg.path or pretrained
        check_tokenizer_kind(tcfg.kind)
        if tcfg.kind == "pretrained" and not source:
            raise CcexpError("model.tokenizer.kind=pretrained needs model.pretrained or model.tokenizer.path")
        model = self.results["model"].fingerprint if "model" in self.results else None
        fp = keys.stage_fingerprint("tokenize", *keys.tokenize_key(
            tcfg, self._content(), model, self.model_digest(source) if tcfg.kind == "pretrained" else None))

        shard_documents = int(self.data.shard_documents)
        work_dir = self.store.root / "tokenize" / f".work-{fp}-s{shard_documents}"  # shards of this size only
        rank, world = launch_rank()

        def produce(tmp: Path) -> dict:
            tok = self._tokenizer(corpus, source, work_dir)
            sep = separator_id(tok, tcfg.separator)
            tokenize_shards(tok, corpus.texts, corpus.prompt_chars, work_dir, shard_documents=shard_documents,
                            rank=rank, world_size=world)
            wait_for_shards(work_dir, -(-len(corpus) // shard_documents), marker="tokens-{:06d}.done", stage="tokenize")
            figures = assemble_tokens(work_dir, len(corpus), shard_documents, tmp)
            shutil.copytree(work_dir / "tokenizer", tmp / "tokenizer")
            shutil.rmtree(work_dir, ignore_errors=True)  # the arrays replace the shards (only the computing run)
            return {**figures, "vocab_size": len(tok), "separator_id": sep, "separator": tok.convert_ids_to_tokens(sep)}

        if rank != 0 and not self.store.is_done("tokenize", fp):  # tokenize this rank's shards, then wait for rank 0
            self.store.wait("tokenize", fp, until=work_dir / "tokenizer.done")
            if not self.store.is_done("tokenize", fp):
                tokenize_shards(load_tokenizer(work_dir / "tokenizer"), corpus.texts, corpus.prompt_chars, work_dir,
                                shard_documents=shard_documents, rank=rank, world_size=world)
            self.store.wait("tokenize", fp)
        result = self.cached("tokenize", fp, produce,
                           lambda f: f"{f['tokens']:,} tokens in {f['documents']:,} docs, vocab {f['vocab_size']:,}, "
                           f"{f['separator']} before each document")
        tokenizer = load_tokenizer(result.path / "tokenizer")
        check_vocabulary(self.model_cfg, pretrained, tokenizer)  # every token id has a row in the model's embedding
        return TokenizedCorpus(np.load(result.path / "tokens.npy", mmap_mode="r"), np.load(result.path / "offsets.npy"),
                               tokenizer, int(result.figures["separator_id"]),
                               np.load(p) if (p := result.path / "prompt_tokens.npy").is_file() else None)

    def _tokenizer(self, corpus: Corpus, source: str | None, work_dir: Path):
        """Train (``kind=bpe``, on the training documents, streamed) or load the tokenizer into
        ``work_dir/tokenizer`` once — a resumed run reuses it, other ranks wait for ``tokenizer.done``."""
        from ccexp.data.tokenize import load_tokenizer, train_bpe_tokenizer

        tcfg = self.model_cfg.tokenizer
        if (work_dir / "tokenizer.done").is_file():
            return load_tokenizer(work_dir / "tokenizer")
        work_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work_dir / "tokenizer", ignore_errors=True)
        if tcfg.kind == "bpe":
            log.info("tokenize: training a %s-token byte-level BPE on the training documents", f"{tcfg.vocab_size:,}")
            tok = train_bpe_tokenizer((t for t, h in zip(corpus.texts, corpus.heldout) if not h), tcfg.vocab_size,
                                      work_dir / "tokenizer")
        else:
            tok = load_tokenizer(source)
            tok.save_pretrained(str(work_dir / "tokenizer"))
        (work_dir / "tokenizer.done").write_text("ok\n")
        return tok


def _log_labels(figures: dict) -> None:
    """The run's labels line: each label field and its number of values, or ``none`` with a hint naming
    the fields that look like labels."""
    found = figures.get("label_values") or {}
    if found:
        log.info("labels: %s", ", ".join(f"{name} ({n:,} values)" for name, n in found.items()))
        return
    hint = figures.get("label_hint") or []
    log.info("labels: none%s", "" if not hint else "; the records carry " + ", ".join(
        f"{field!r} ({n} values, e.g. {', '.join(map(repr, examples))})" for field, n, examples in hint)
        + f": data.label_fields=[{hint[0][0]}] gives held-out perplexity and exposure per {hint[0][0]}")


def train_split(corpus: Corpus, clustering: Clustering, level: int, selected: np.ndarray | None = None) -> TrainSplit:
    """The training and held-out documents at clustering level ``level`` (``selected``: bool[N], the
    training documents a balanced selection kept).

    Raises:
        CcexpError: if the clustering has no such level.
    """
    lv = clustering.level(level)
    train = ~corpus.heldout if selected is None else np.asarray(selected, dtype=bool) & ~corpus.heldout
    train_docs = np.flatnonzero(train)
    return TrainSplit(train_docs, np.flatnonzero(corpus.heldout), lv.labels, lv.similarity,
                      np.bincount(lv.labels[train_docs], minlength=lv.k).astype(np.int64), lv.names)


def select(selection: DictConfig, corpus: Corpus, clustering: Clustering,
           kept: np.ndarray | None = None) -> np.ndarray | None:
    """The balanced selection step (``selection.target``; [`ccexp.clustering.selection`][ccexp.clustering.selection]) over the
    training documents that curation ``kept`` (bool[N]; None: all): bool[N], the training documents
    kept, or None to keep them all."""
    if selection.target is None:
        return kept
    from ccexp.clustering.selection import balanced_selection

    pool = ~corpus.heldout if kept is None else ~corpus.heldout & kept
    if selection.target >= int(pool.sum()):
        log.warning("select: selection.target=%d but only %s training documents are left%s; all are kept",
                    selection.target, f"{int(pool.sum()):,}", " after dedup" if kept is not None else "")
    selected = balanced_selection(clustering.levels, pool, selection.target,
                                  strategy=selection.strategy, seed=int(selection.seed))
    log.log(logging.WARNING if selected.sum() < pool.sum() / 2 else logging.INFO,
            "select: %s of %s training documents kept, balanced over the %s clusters of %d level(s)%s",
            f"{int(selected.sum()):,}", f"{int(pool.sum()):,}", "/".join(str(lv.k) for lv in clustering.levels),
            len(clustering.levels), "; more than half were dropped (selection.target)" if selected.sum() < pool.sum() / 2
            else "")
    return selected
