"""The cached preprocessing stages — corpus -> embed -> cluster, and tokenize — returning typed artifacts.

Each stage's output lives in ``<paths.cache>/<stage>/<fingerprint>/`` (:mod:`ccexp.artifacts`); a
run whose stage config and inputs are unchanged reuses it and logs ``reused=True``. Each stage
logs one line with its figures. File names stay inside this module: callers get
:class:`~ccexp.data.corpus.Corpus`, :class:`Embeddings`, :class:`~ccexp.clustering.kmeans.Clustering`
and :class:`TokenizedCorpus`, and :func:`train_split` turns them into the :class:`TrainSplit` a
sampler trains on.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from ccexp import stage_keys as keys
from ccexp.artifacts import StageStore
from ccexp.build import build
from ccexp.clustering.kmeans import Clustering, Level
from ccexp.data.corpus import BUILTIN_PATH, Corpus
from ccexp.data.split import TrainSplit
from ccexp.data.tokenize import TokenizedCorpus
from ccexp.errors import CcexpError, Interrupted
from ccexp.preflight import uses_reference_run

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
    """The cached stages of one run. Call them in order; :attr:`results` keeps each stage's
    :class:`StageResult` (for the run's record), and later stages key on earlier ones' content.

    Args:
        cfg: the run's config.
        store: the stage store under ``paths.cache``.
    """

    def __init__(self, cfg: DictConfig, store: StageStore):
        self.cfg, self.store = cfg, store
        self.results: dict[str, StageResult] = {}

    def _run(self, stage: str, fp: str, produce, describe) -> StageResult:
        """Reuse ``<stage>/<fp>`` if done, else call ``produce(tmp_dir) -> figures`` and publish it."""
        t0 = time.perf_counter()
        reused = self.store.is_done(stage, fp)
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
        ``data.shard_documents`` documents (id, text, heldout, labels; :mod:`ccexp.data.store`), the
        held-out split decided per document. No step holds the whole corpus: the returned
        :class:`Corpus` reads its texts from the shards on demand.

        Raises:
            CcexpError: from the reader (missing file, bad records) or the split.
        """
        from ccexp.data.store import open_corpus, write_corpus

        d = self.cfg.data
        src = BUILTIN_PATH if d.path == "builtin" else Path(d.path).expanduser().resolve()
        reader = build(d, "data", path=src)  # raises the one-line "does not exist" error
        fp = keys.stage_fingerprint("corpus", *keys.corpus_key(d, self._digest(src)))
        result = self._run("corpus", fp, lambda tmp: {**write_corpus(
            reader.batches(int(d.shard_documents)), tmp, heldout_fraction=d.heldout_fraction,
            label_fields=list(d.label_fields), stratify=d.heldout_stratify, min_per_value=int(d.heldout_min_per_value)),
            "source": str(src), "label_hint": reader.label_hint},
            lambda f: f"{f['documents']:,} docs ({f['heldout']:,} held out) in {f.get('shards', 1)} shard(s) from "
                      f"{Path(f['source']).name}")
        _log_labels(result.figures)
        return open_corpus(result.path)

    def _content(self) -> str:
        return self.results["corpus"].figures["content"]

    def _labels(self) -> str | None:
        """The digest of the corpus's label values (None without labels): what the stages' reports read."""
        return self.results["corpus"].figures.get("labels")

    def _digest(self, path: str | Path) -> str:
        """:func:`ccexp.stage_keys.content_digest` of a file or folder, remembered under the stage cache."""
        return keys.content_digest(path, self.store.root / "digests.json")

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
        fp = keys.stage_fingerprint("embed", *keys.embed_key(self.cfg.embedder, self._content(), model))
        work_dir = self.store.root / "embed" / f".work-{fp}"
        rank, world = launch_rank()

        def produce(tmp: Path) -> dict:
            t0 = time.perf_counter()
            emb, stats = build(self.cfg.embedder, "embedder", **runtime).embed(
                corpus.texts, tmp / "embeddings.npy", work_dir, rank=rank, world_size=world, **extra)
            secs = time.perf_counter() - t0
            shutil.rmtree(work_dir, ignore_errors=True)  # the array replaces the shards (only the computing run)
            return {"documents": emb.shape[0], "dim": emb.shape[1], "seconds": secs, "docs_per_s": emb.shape[0] / secs,
                    "shards": len(stats["embedded"]) + len(stats["skipped"]), "shards_resumed": len(stats["skipped"]),
                    "long_documents": stats["long_documents"], "max_seq_length": self.cfg.embedder.max_seq_length,
                    "long_documents_mode": OmegaConf.select(self.cfg, "embedder.long_documents", default="truncate")}

        if rank != 0 and not self.store.is_done("embed", fp):  # embed this rank's shards, then wait for rank 0
            build(self.cfg.embedder, "embedder", **runtime).embed(corpus.texts, work_dir / "unused.npy", work_dir,
                                                                  rank=rank, world_size=world, **extra)
            self.store.wait("embed", fp)
        result = self._run("embed", fp, produce, lambda f: f"{f['documents']:,} docs, dim {f['dim']}, "
                           f"{f['docs_per_s']:.0f} docs/s when computed, {f.get('shards', 1)} shards"
                           + (f" ({f['shards_resumed']} resumed)" if f.get("shards_resumed") else ""))
        long, mode = result.figures.get("long_documents", 0), result.figures.get("long_documents_mode", "truncate")
        if long and "long_documents" not in self.cfg.embedder:  # the gradient proxy reads the first tokens
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
        import inspect

        from hydra.utils import get_method

        from ccexp.training.pretrained import is_gguf, resolve_pretrained

        target = get_method(self.cfg.embedder._target_)
        runtime, model = {}, None
        spec = OmegaConf.select(self.cfg, "embedder.model", default="model")
        if "pretrained" in inspect.signature(target).parameters:
            runtime["pretrained"] = pretrained if spec == "model" else resolve_pretrained(spec)
            if is_gguf(runtime["pretrained"] or ""):
                raise CcexpError(f"embedder.model={spec!r} is a GGUF file; make it the run's model.pretrained and "
                                 "set embedder.model=model (its converted folder is used)")
            model = (self.results["model"].fingerprint if "model" in self.results else
                     self._model_digest(pretrained)) if spec == "model" else self._model_digest(runtime["pretrained"])
        else:
            from ccexp.embedding.sentence import resolve_model_path

            model = self._digest(resolve_model_path(spec))
        extra = ({"prompt_chars": corpus.prompt_chars} if "prompt_chars" in inspect.signature(target.embed).parameters
                 else {})
        return runtime, extra, model

    def _model_digest(self, source: str | None) -> str | None:
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
        fp = keys.stage_fingerprint("cluster", *keys.cluster_key(self.cfg.clusterer, self.results["embed"].fingerprint,
                                                                  self._content(), self._labels()))

        def produce(tmp: Path) -> dict:
            from ccexp.clustering.report import write_cluster_report

            clusterer = build(self.cfg.clusterer, "clusterer")
            extra = {"label_values": corpus.labels} if "label_field" in self.cfg.clusterer else {}
            result = clusterer.fit(embeddings.vectors, ~corpus.heldout, **extra)
            for depth, level in enumerate(result.levels):
                for name in _LEVEL_ARRAYS:
                    if getattr(level, name) is not None:
                        np.save(tmp / f"level{depth}_{name}.npy", getattr(level, name))
            finest = result.levels[0]
            report = write_cluster_report(tmp / "report", labels=finest.labels, sizes=finest.sizes,
                                          similarity=finest.similarity, texts=corpus.texts, label_values=corpus.labels,
                                          train_mask=~corpus.heldout,
                                          title=f"{self.cfg.data.name} / {self.cfg.clusterer.name} seed "
                                          f"{OmegaConf.select(self.cfg, 'clusterer.seed', default='-')}")
            return {"levels": [lv.k for lv in result.levels], "train_points": result.train_points,
                    "objective": result.objective, "largest": int(finest.sizes.max()),
                    "smallest": int(finest.sizes.min()), "empty": int((finest.sizes == 0).sum()), "report": report}

        result = self._run("cluster", fp, produce, lambda f: f"K={'/'.join(map(str, f['levels']))}, trained on "
                           f"{f['train_points']:,} points, sizes {f['smallest']}..{f['largest']} ({f['empty']} empty)")
        levels = [Level(**{name: np.load(p) if (p := result.path / f"level{depth}_{name}.npy").is_file() else None
                           for name in _LEVEL_ARRAYS}) for depth in range(len(result.figures["levels"]))]
        return Clustering(levels, int(result.figures["train_points"]), float(result.figures["objective"]))

    # -- dedup ------------------------------------------------------------------------------------
    def dedup(self, corpus: Corpus, embeddings: Embeddings, clustering: Clustering) -> np.ndarray | None:
        """Semantic deduplication of the training documents inside the finest clusters when
        ``curate.dedup.enabled`` (:func:`ccexp.clustering.dedup.semantic_dedup`): bool[N], False for a
        removed near-duplicate; None when off. Its report (``report/``): removals per cluster and per
        label value (CSV) and example pairs (Markdown).

        Raises:
            CcexpError: for an invalid threshold or ``keep``, or non-finite embeddings.
        """
        d = self.cfg.curate.dedup
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

        result = self._run("dedup", fp, produce, lambda f: f"{f['removed']:,} near-duplicates of {f['searched']:,} "
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
        from ccexp.training.pretrained import convert_gguf, is_gguf, resolve_pretrained

        spec = OmegaConf.select(self.cfg, "model.pretrained")
        if spec is None:
            return None
        path = resolve_pretrained(spec)
        if not is_gguf(path):
            return path
        fp = keys.stage_fingerprint("model", {}, {"gguf": self._digest(path)})
        result = self._run("model", fp, lambda tmp: convert_gguf(path, tmp / "hf"),
                           lambda f: f"{f['architecture']} with {f['parameters'] / 1e6:.1f}M parameters, vocab "
                           f"{f['vocab_size']:,}, from {Path(f['source']).name}")
        return str(result.path / "hf")

    # -- tokenize ---------------------------------------------------------------------------------
    def tokenize(self, corpus: Corpus, pretrained: str | None = None) -> TokenizedCorpus:
        """Train (or load) the tokenizer and tokenize every document (``pretrained``: the model's
        local source from :meth:`model`, whose tokenizer ``kind=pretrained`` uses).

        Raises:
            CcexpError: for an unknown tokenizer kind, a tokenizer that cannot be loaded, or a
                ``model.tokenizer.separator`` it does not have.
        """
        from ccexp.data.tokenize import assemble_tokens, load_tokenizer, separator_id, tokenize_shards
        from ccexp.embedding.shards import launch_rank, wait_for_shards

        tcfg = self.cfg.model.tokenizer
        source = tcfg.path or pretrained
        if tcfg.kind not in ("bpe", "pretrained"):
            raise CcexpError(f"model.tokenizer.kind={tcfg.kind!r} is not an option; use bpe or pretrained")
        if tcfg.kind == "pretrained" and not source:
            raise CcexpError("model.tokenizer.kind=pretrained needs model.pretrained or model.tokenizer.path")
        model = self.results["model"].fingerprint if "model" in self.results else None
        fp = keys.stage_fingerprint("tokenize", *keys.tokenize_key(
            tcfg, self._content(), model, self._model_digest(source) if tcfg.kind == "pretrained" else None))

        shard_documents = int(self.cfg.data.shard_documents)
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
        result = self._run("tokenize", fp, produce,
                           lambda f: f"{f['tokens']:,} tokens in {f['documents']:,} docs, vocab {f['vocab_size']:,}, "
                           f"{f['separator']} before each document")
        return TokenizedCorpus(np.load(result.path / "tokens.npy", mmap_mode="r"), np.load(result.path / "offsets.npy"),
                               load_tokenizer(result.path / "tokenizer"), int(result.figures["separator_id"]),
                               np.load(p) if (p := result.path / "prompt_tokens.npy").is_file() else None)

    def _tokenizer(self, corpus: Corpus, source: str | None, work_dir: Path):
        """Train (``kind=bpe``, on the training documents, streamed) or load the tokenizer into
        ``work_dir/tokenizer`` once — a resumed run reuses it, other ranks wait for ``tokenizer.done``."""
        from ccexp.data.tokenize import load_tokenizer, train_bpe_tokenizer

        tcfg = self.cfg.model.tokenizer
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

    # -- reference (DoReMi) ---------------------------------------------------------------------
    def reference(self, split: TrainSplit, tokenized: TokenizedCorpus, pretrained: str | None = None) -> np.ndarray | None:
        """DoReMi's per-cluster reference losses (float64[K], nats/token) when ``sampler.rule=doremi`` and
        ``sampler.reference_losses=auto``; None otherwise (the sampler reads a given list or file itself).

        The reference model is the run's model trained from the same start for ``sampler.reference_steps``
        optimizer steps of the same token budget with ``sampler=random`` (the natural mix: DoReMi's
        reference, Xie et al. 2023, Sec. 2, trained on the default domain weights), on one device; it is
        then scored on up to ``sampler.reference_documents`` training documents of every cluster (a fixed
        sample), its loss per cluster being the token-weighted mean. Cached as ``<cache>/reference/<fp>``,
        so a sweep over DoReMi's settings trains it once. The global random state is restored afterwards,
        so the run's own model starts the same whether the reference was computed or reused.

        Raises:
            CcexpError: from training (e.g. a non-finite loss).
        """
        if not uses_reference_run(self.cfg):
            return None
        steps = int(self.cfg.sampler.reference_steps)
        # the documents it trains on and their clusters (after dedup and selection), not only the stages' keys
        split_digest = hashlib.sha256(np.ascontiguousarray(split.train_docs, dtype=np.int64).tobytes()
                                      + np.ascontiguousarray(split.labels[split.train_docs], dtype=np.int64).tobytes())
        upstream = {name: r.fingerprint for name, r in self.results.items() if name in ("corpus", "cluster", "tokenize",
                                                                                       "model")}
        fp = keys.stage_fingerprint("reference", *keys.reference_key(self.cfg, upstream, self._model_digest(pretrained),
                                                                      split_digest.hexdigest()))
        result = self._run("reference", fp, lambda tmp: _train_reference(self.cfg, steps, split, tokenized,
                                                                         pretrained, tmp),
                           lambda f: f"a {f['steps']}-step sampler=random model scored on {f['documents']:,} "
                           f"training docs: loss {f['loss_min']:.2f}..{f['loss_max']:.2f} nats/token over "
                           f"{f['clusters']} clusters")
        return np.load(result.path / "reference_losses.npy")


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


def _train_reference(cfg: DictConfig, steps: int, split: TrainSplit, tokenized: TokenizedCorpus,
                     pretrained: str | None, tmp: Path) -> dict:
    """Train and score :meth:`Stages.reference`'s model into ``tmp``; its figures."""
    import random

    import torch

    from ccexp.config import RandomConfig
    from ccexp.evaluation.perplexity import document_nll
    from ccexp.training import runner

    ref = cfg.copy()
    with open_dict(ref):
        ref.sampler = OmegaConf.structured(RandomConfig(name="random", level=cfg.sampler.level,
                                                        seed=int(cfg.sampler.seed)))
        ref.train.steps, ref.train.resume_from, ref.train.checkpoint_every_n_steps = steps, None, None
        ref.train.record_batches, ref.eval.every_n_steps = False, None
        ref.trainer.devices, ref.trainer.num_nodes, ref.trainer.strategy = 1, 1, "auto"
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        log.info("reference: training the DoReMi reference model, %d steps with sampler=random", steps)
        sampler = runner.build_sampler(ref, split, tokenized)
        stream = runner.build_token_stream(ref, sampler, split, tokenized)
        try:
            fit = runner.fit(ref, tmp / "run", None, stream, runner.build_model(ref, tokenized, pretrained), tokenized,
                             split, {}, signature={})
        except Interrupted as e:  # its checkpoint lives in the discarded stage folder: nothing to resume from
            raise Interrupted(e.signum, f"stopped by {e.name} while training DoReMi's reference model (the reference "
                              "stage is not kept; the next run trains it again)") from None
        rng = np.random.default_rng([int(cfg.sampler.seed), 0x5245])  # "RE": the same sample for every DoReMi setting
        docs = rng.permutation(split.train_docs)
        clusters = split.labels[docs]
        order = np.argsort(clusters, kind="stable")  # each cluster's first documents of the permutation
        rank = np.arange(docs.size) - np.searchsorted(clusters[order], clusters[order])
        sample = np.sort(docs[order][rank < int(cfg.sampler.reference_documents)])
        tok = tokenized.tokenizer
        nll, ntok = document_nll(fit.model, tokenized.tokens, tokenized.offsets, sample, eos_id=tokenized.separator_id,
                                 pad_id=tok.pad_token_id, max_tokens=cfg.eval.max_tokens,
                                 batch_size=cfg.eval.batch_size, prompt_tokens=tokenized.prompt_tokens,
                                 device=next(fit.model.parameters()).device)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
    k = split.num_clusters
    loss_sum = np.bincount(split.labels[sample], weights=nll, minlength=k)
    token_sum = np.bincount(split.labels[sample], weights=ntok, minlength=k)
    scored = token_sum > 0
    losses = np.full(k, float(loss_sum.sum() / max(token_sum.sum(), 1)))  # clusters without training docs
    losses[scored] = loss_sum[scored] / token_sum[scored]
    np.save(tmp / "reference_losses.npy", losses)
    shutil.rmtree(tmp / "run", ignore_errors=True)  # its checkpoints: the losses are the stage's output
    return {"steps": steps, "documents": int(sample.size), "tokens": int(token_sum.sum()), "clusters": int(scored.sum()),
            "loss_min": float(losses[scored].min()), "loss_max": float(losses[scored].max()),
            "train_seconds": fit.seconds}


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
                      np.bincount(lv.labels[train_docs], minlength=lv.k).astype(np.int64))


def select(cfg: DictConfig, corpus: Corpus, clustering: Clustering, kept: np.ndarray | None = None) -> np.ndarray | None:
    """The balanced selection step (``selection.target``; :mod:`ccexp.clustering.selection`) over the
    training documents that curation ``kept`` (bool[N]; None: all): bool[N], the training documents
    kept, or None to keep them all."""
    if cfg.selection.target is None:
        return kept
    from ccexp.clustering.selection import balanced_selection

    pool = ~corpus.heldout if kept is None else ~corpus.heldout & kept
    if cfg.selection.target >= int(pool.sum()):
        log.warning("select: selection.target=%d but only %s training documents are left%s; all are kept",
                    cfg.selection.target, f"{int(pool.sum()):,}", " after dedup" if kept is not None else "")
    selected = balanced_selection(clustering.levels, pool, cfg.selection.target,
                                  strategy=cfg.selection.strategy, seed=int(cfg.selection.seed))
    log.log(logging.WARNING if selected.sum() < pool.sum() / 2 else logging.INFO,
            "select: %s of %s training documents kept, balanced over the %s clusters of %d level(s)%s",
            f"{int(selected.sum()):,}", f"{int(pool.sum()):,}", "/".join(str(lv.k) for lv in clustering.levels),
            len(clustering.levels), "; more than half were dropped (selection.target)" if selected.sum() < pool.sum() / 2
            else "")
    return selected
