"""The cached preprocessing stages: corpus -> embed -> cluster, and tokenize.

Each stage's output lives in ``<paths.cache>/<stage>/<fingerprint>/`` (:mod:`ccexp.artifacts`); a
run whose stage config and inputs are unchanged reuses it and logs ``reused=True``. Each stage
logs one line with its figures.
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
from omegaconf import DictConfig, OmegaConf

from ccexp.artifacts import StageStore, file_digest, fingerprint
from ccexp.build import build
from ccexp.data.corpus import BUILTIN_PATH, Corpus, read_corpus, split_heldout
from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")

# bump a stage's version when its output format or algorithm changes
VERSIONS = {"corpus": 2, "embed": 2, "cluster": 2, "tokenize": 1}


@dataclass
class StageResult:
    stage: str
    path: Path
    fingerprint: str
    reused: bool
    seconds: float
    figures: dict = field(default_factory=dict)


def _config(node: DictConfig, drop: tuple[str, ...] = ()) -> dict:
    cfg = OmegaConf.to_container(node, resolve=True)
    return {k: v for k, v in cfg.items() if k not in drop}


def _run_stage(store: StageStore, stage: str, fp: str, produce, describe) -> StageResult:
    """Reuse ``<stage>/<fp>`` if done, else call ``produce(tmp_dir) -> meta dict`` and publish it."""
    t0 = time.perf_counter()
    reused = store.is_done(stage, fp)
    if not reused:
        with store.publish(stage, fp) as tmp:
            meta = produce(tmp)
            (tmp / "figures.json").write_text(json.dumps(meta, indent=2, default=str))
    path = store.path(stage, fp)
    figures = json.loads((path / "figures.json").read_text())
    seconds = time.perf_counter() - t0
    log.info("%s: %s, reused=%s, %.1f s, fingerprint %s", stage, describe(figures), reused, seconds, fp[:6])
    return StageResult(stage, path, fp, reused, seconds, figures)


# -- corpus ---------------------------------------------------------------------------------------
def corpus_path(cfg: DictConfig) -> Path:
    return BUILTIN_PATH if cfg.data.path == "builtin" else Path(cfg.data.path).expanduser().resolve()


def run_corpus(cfg: DictConfig, store: StageStore) -> StageResult:
    """Read, validate and split the corpus; store it as Parquet (id, text, heldout, labels)."""
    src = corpus_path(cfg)
    read_corpus_args = dict(format=cfg.data.format, text_field=cfg.data.text_field, id_field=cfg.data.id_field,
                            label_fields=list(cfg.data.label_fields), drop_empty=cfg.data.drop_empty,
                            max_documents=cfg.data.max_documents)
    if not src.is_file():
        read_corpus(src, **read_corpus_args)  # raises the one-line "does not exist" error
    fp = fingerprint("corpus", VERSIONS["corpus"], {**_config(cfg.data, ("name", "path")), "file": file_digest(src)})

    def produce(tmp: Path) -> dict:
        import pyarrow as pa
        import pyarrow.parquet as pq

        corpus = read_corpus(src, **read_corpus_args)
        heldout = split_heldout(corpus.ids, cfg.data.heldout_fraction)
        content = hashlib.sha256()
        for doc_id, text, held in zip(corpus.ids, corpus.texts, heldout):
            content.update(f"{len(doc_id)}:{doc_id}{len(text)}:{text}{int(held)}".encode())
        table = pa.table({"id": corpus.ids, "text": corpus.texts, "heldout": heldout,
                          **{f"label.{k}": v for k, v in corpus.labels.items()}})
        pq.write_table(table, tmp / "corpus.parquet")
        return {"documents": len(corpus), "heldout": int(heldout.sum()), "source": str(src),
                "content": content.hexdigest()[:16],
                "label_fields": list(corpus.labels)}

    return _run_stage(store, "corpus", fp, produce,
                      lambda f: f"{f['documents']:,} docs ({f['heldout']:,} held out) from {Path(f['source']).name}")


def load_corpus(result: StageResult) -> Corpus:
    import pyarrow.parquet as pq

    table = pq.read_table(result.path / "corpus.parquet").to_pydict()
    labels = {k[len("label."):]: v for k, v in table.items() if k.startswith("label.")}
    return Corpus(table["id"], table["text"], labels, np.asarray(table["heldout"], dtype=bool))


# -- embed ----------------------------------------------------------------------------------------
def run_embed(cfg: DictConfig, store: StageStore, corpus: StageResult) -> StageResult:
    """Embed every document (float16[N, d], L2-normalised) into ``embeddings.npy``.

    Shards are written to ``<cache>/embed/.work-<fingerprint>/`` as they finish, so an interrupted
    run resumes with the unfinished shards; under torchrun/srun every rank embeds its share and
    rank 0 assembles and publishes the array.
    """
    from ccexp.embedding.shards import launch_rank

    fp = fingerprint("embed", VERSIONS["embed"], _config(cfg.embedder, ("name", "device", "batch_size")),
                     {"corpus": corpus.figures["content"]})
    work_dir = store.root / "embed" / f".work-{fp}"
    rank, world = launch_rank()

    def produce(tmp: Path) -> dict:
        texts = load_corpus(corpus).texts
        embedder = build(cfg.embedder, "embedder")
        t0 = time.perf_counter()
        emb = embedder.embed(texts, tmp / "embeddings.npy", work_dir, rank=rank, world_size=world)
        secs = time.perf_counter() - t0
        stats = embedder.last_stats
        return {"documents": emb.shape[0], "dim": emb.shape[1], "seconds": secs, "docs_per_s": emb.shape[0] / secs,
                "shards": len(stats["embedded"]) + len(stats["skipped"]), "shards_resumed": len(stats["skipped"])}

    if rank != 0 and not store.is_done("embed", fp):  # embed this rank's shards, then wait for rank 0
        texts = load_corpus(corpus).texts
        build(cfg.embedder, "embedder").embed(texts, work_dir / "unused.npy", work_dir, rank=rank, world_size=world)
        while not store.is_done("embed", fp):
            time.sleep(5)
    result = _run_stage(store, "embed", fp, produce, lambda f: f"{f['documents']:,} docs, dim {f['dim']}, "
                        f"{f['docs_per_s']:.0f} docs/s when computed, {f.get('shards', 1)} shards"
                        + (f" ({f['shards_resumed']} resumed)" if f.get("shards_resumed") else ""))
    if rank == 0 and work_dir.exists():
        shutil.rmtree(work_dir, ignore_errors=True)  # the published array replaces the shards
    return result


# -- cluster --------------------------------------------------------------------------------------
def run_cluster(cfg: DictConfig, store: StageStore, corpus: StageResult, embed: StageResult) -> StageResult:
    """k-means on the training documents' embeddings; labels for every document."""
    fp = fingerprint("cluster", VERSIONS["cluster"], _config(cfg.clusterer, ("name", "verbose", "assign_batch")),
                     {"embed": embed.fingerprint, "corpus": corpus.figures["content"]})

    def produce(tmp: Path) -> dict:
        from ccexp.clustering.report import write_cluster_report

        c = load_corpus(corpus)
        emb = np.load(embed.path / "embeddings.npy", mmap_mode="r")
        result = build(cfg.clusterer, "clusterer").fit(emb, ~c.heldout)
        for name in ("labels", "centroids", "sizes", "similarity"):
            np.save(tmp / f"level0_{name}.npy", getattr(result, name))
        for depth, level in enumerate(result.levels, start=1):
            for name in ("labels", "centroids", "sizes", "similarity", "parent"):
                np.save(tmp / f"level{depth}_{name}.npy", level[name])
        if result.selected is not None:
            np.save(tmp / "selected.npy", result.selected)
        sizes = result.sizes
        report = write_cluster_report(tmp / "report", labels=result.labels, sizes=sizes, similarity=result.similarity,
                                      texts=c.texts, label_values=c.labels, train_mask=~c.heldout)
        return {"k": int(sizes.size), "levels": [int(sizes.size)] + [int(lv["sizes"].size) for lv in result.levels],
                "train_points": result.train_points, "objective": result.objective,
                "largest": int(sizes.max()), "smallest": int(sizes.min()), "empty": int((sizes == 0).sum()),
                "selected": None if result.selected is None else int(result.selected.sum()), "report": report}

    return _run_stage(store, "cluster", fp, produce, lambda f: f"K={'/'.join(map(str, f['levels']))}, trained on "
                      f"{f['train_points']:,} points, sizes {f['smallest']}..{f['largest']} ({f['empty']} empty)"
                      + (f", {f['selected']:,} documents selected" if f.get("selected") is not None else ""))


def load_level(cluster: StageResult, level: int) -> tuple[np.ndarray, np.ndarray]:
    """labels int32[N] and similarity float32[N] of clustering level ``level`` (0 = finest).

    Raises:
        CcexpError: if the clustering has no such level.
    """
    levels = cluster.figures["levels"]
    if not 0 <= level < len(levels):
        raise CcexpError(f"sampler.level={level} but the clustering has {len(levels)} level(s) ({levels}); "
                         f"use a level in 0..{len(levels) - 1}")
    return np.load(cluster.path / f"level{level}_labels.npy"), np.load(cluster.path / f"level{level}_similarity.npy")


# -- tokenize -------------------------------------------------------------------------------------
def run_tokenize(cfg: DictConfig, store: StageStore, corpus: StageResult) -> StageResult:
    """Train (or load) the tokenizer and tokenize every document into ``tokens.npy``/``offsets.npy``."""
    from ccexp.data.tokenize import encode_corpus, load_tokenizer, train_bpe_tokenizer

    tcfg = cfg.model.tokenizer
    source = tcfg.path or OmegaConf.select(cfg, "model.pretrained")
    if tcfg.kind == "bpe":
        key = {"kind": "bpe", "vocab_size": tcfg.vocab_size}
    elif tcfg.kind == "pretrained":
        key = {"kind": "pretrained", "path": source}
    else:
        raise CcexpError(f"model.tokenizer.kind={tcfg.kind!r} is not an option; use bpe or pretrained")
    fp = fingerprint("tokenize", VERSIONS["tokenize"], key, {"corpus": corpus.figures["content"]})

    def produce(tmp: Path) -> dict:
        c = load_corpus(corpus)
        if tcfg.kind == "bpe":
            train_texts = [t for t, h in zip(c.texts, c.heldout) if not h]
            tok = train_bpe_tokenizer(train_texts, tcfg.vocab_size, tmp / "tokenizer")
        else:
            tok = load_tokenizer(source)
            tok.save_pretrained(str(tmp / "tokenizer"))
        tokens, offsets = encode_corpus(tok, c.texts)
        np.save(tmp / "tokens.npy", tokens)
        np.save(tmp / "offsets.npy", offsets)
        return {"documents": len(c.texts), "tokens": int(tokens.size), "vocab_size": len(tok)}

    return _run_stage(store, "tokenize", fp, produce,
                      lambda f: f"{f['tokens']:,} tokens in {f['documents']:,} docs, vocab {f['vocab_size']:,}")
