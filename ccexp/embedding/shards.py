"""Sharded, resumable embedding (the datatrove pattern: completion markers, skip what is done).

The corpus is cut into shards of ``shard_size`` documents. Each shard's embeddings are written as
float16 ``shard-<i>.npy`` (to a temporary name, then renamed) followed by a ``shard-<i>.done``
marker, so a killed run leaves only whole shards behind and a rerun embeds the unfinished ones
only. Shards are spread over the ranks of a data-parallel launch (``RANK`` / ``WORLD_SIZE`` from
torchrun or srun): rank r takes shards ``i ≡ r (mod W)``; rank 0 waits for every marker (a
file-system barrier, so no process group is needed) and assembles one memory-mapped array.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")


def launch_rank() -> tuple[int, int]:
    """(rank, world size) of a launch from the environment: torchrun's ``RANK`` and ``WORLD_SIZE``, srun's
    ``SLURM_PROCID`` and ``SLURM_NTASKS``, or, for the processes Lightning's own launcher starts (``trainer=ddp``,
    ``trainer.devices=N`` without torchrun: it sets ``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE``, no ``RANK``),
    ``NODE_RANK x processes per node + LOCAL_RANK`` (per node: ``LOCAL_WORLD_SIZE`` when set, else taken as the
    whole world, which keeps a process of another node from ever reading as rank 0); (0, 1) outside a launch."""
    env = os.environ
    world = max(1, int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1))))
    if "RANK" in env or "SLURM_PROCID" in env:
        return int(env.get("RANK", env.get("SLURM_PROCID", 0))), world
    if "LOCAL_RANK" in env:
        per_node = int(env.get("LOCAL_WORLD_SIZE") or world)
        return int(env.get("NODE_RANK") or 0) * per_node + int(env["LOCAL_RANK"]), world
    return 0, world


def local_rank() -> int:
    """This process's rank on its node in a torchrun/srun launch (``LOCAL_RANK``, ``SLURM_LOCALID``); 0 otherwise."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))


def launch_device(configured: str) -> str:
    """The torch device an embedder computes on in this process (its ``device`` setting): ``cpu`` and an explicit
    ``cuda:N`` as given; ``cuda``, and ``auto`` where CUDA is visible, are this rank's own GPU in a launch of several
    ranks (``cuda:<rank on this node mod the GPUs it sees>``: every rank of a node embeds its shards on its own GPU,
    never all on GPU 0) and ``cuda`` otherwise; ``auto`` without CUDA is the CPU."""
    if configured == "cpu" or configured.startswith("cuda:"):
        return configured
    import torch

    if configured == "auto" and not torch.cuda.is_available():
        return "cpu"
    if launch_rank()[1] > 1 and torch.cuda.is_available():
        return f"cuda:{local_rank() % torch.cuda.device_count()}"
    return "cuda" if configured == "auto" else configured


def shard_path(work_dir: Path, i: int) -> Path:
    return work_dir / f"shard-{i:06d}.npy"


def done_marker(work_dir: Path, i: int) -> Path:
    return work_dir / f"shard-{i:06d}.done"


HEARTBEAT_S = 30  # seconds between progress lines within a shard
PIECE = 256  # documents per encode call within a shard (the unit of those lines)


def embed_shards(encode: Callable[[list[str]], tuple[np.ndarray, int]], texts: list[str], work_dir: Path, *,
                 shard_size: int, rank: int = 0, world_size: int = 1, progress: bool = True) -> dict:
    """Embed this rank's unfinished shards of ``texts`` into ``work_dir``.

    Args:
        encode: documents -> (float32[n, d] L2-normalised embeddings, documents over the model's length).
        shard_size: documents per shard.

    Returns:
        ``{"embedded": [...], "skipped": [...], "long_documents": n}``: the shard numbers embedded now
        and found done, and the documents of this rank's shards over the model's length (each shard's
        count is kept in its completion marker, so a resumed run counts them all).

    Raises:
        CcexpError: if an embedding is not finite (the document is named).
    """
    if shard_size < 1:
        raise CcexpError(f"embedder.shard_size must be >= 1, got {shard_size}")
    work_dir.mkdir(parents=True, exist_ok=True)
    n_shards = -(-len(texts) // shard_size)
    mine = list(range(rank, n_shards, world_size))
    skipped = [i for i in mine if done_marker(work_dir, i).is_file()]
    todo = [i for i in mine if i not in set(skipped)]
    docs_todo = sum(min(shard_size, len(texts) - i * shard_size) for i in todo)
    if skipped:
        log.info("embed: resuming, %d of %d shards already done", len(skipped), len(mine))
    if progress and todo:
        log.info("embed: %s documents in %d shard(s) of up to %s; a line every shard and every %d s within one",
                 f"{docs_todo:,}", len(todo), f"{shard_size:,}", HEARTBEAT_S)
    t0, docs_done, last = time.perf_counter(), 0, time.perf_counter()
    for n, i in enumerate(todo, start=1):
        start = i * shard_size
        end = min(start + shard_size, len(texts))

        def alive(done_here: int, is_last: bool) -> None:  # a sign of life within a shard, but at its end
            nonlocal last
            now = time.perf_counter()
            if progress and now - last >= HEARTBEAT_S and not is_last:
                last = now
                log.info("embed: shard %d/%d, %s of %s documents, %.0f docs/s", n, len(todo),
                         f"{docs_done + done_here:,}", f"{docs_todo:,}", (docs_done + done_here) / (now - t0))

        emb, long = embed_in_length_order(encode, texts, start, end, alive)
        bad = np.flatnonzero(~np.isfinite(emb).all(axis=1))
        if bad.size:
            raise CcexpError(f"embedding of document {start + bad[0]} is not finite; check that document or the "
                             "embedder model")
        tmp = work_dir / f".shard-{i:06d}.{os.getpid()}.npy"
        np.save(tmp, emb.astype(np.float16))
        os.replace(tmp, shard_path(work_dir, i))
        done_marker(work_dir, i).write_text(json.dumps({"rows": int(emb.shape[0]), "long_documents": int(long)}))
        docs_done += emb.shape[0]
        if progress:
            last = time.perf_counter()
            rate = docs_done / max(time.perf_counter() - t0, 1e-9)
            log.info("embed: shard %d/%d%s, %s of %s documents, %.0f docs/s, ETA %.0f s", n, len(todo),
                     f" (rank {rank})" if world_size > 1 else "", f"{docs_done:,}", f"{docs_todo:,}", rate,
                     (docs_todo - docs_done) / rate)
    long_total = sum(_marker(work_dir, i).get("long_documents", 0) for i in mine)
    return {"embedded": todo, "skipped": skipped, "long_documents": long_total}


def embed_in_length_order(encode: Callable[[list[str]], tuple[np.ndarray, int]], texts: list[str], start: int,
                          end: int, alive: Callable[[int, bool], None]) -> tuple[np.ndarray, int]:
    """float32[end - start, d] embeddings of ``texts[start:end]`` in corpus order, and how many were long.

    The documents go to ``encode`` by length (characters), [`PIECE`][ccexp.embedding.shards.PIECE] at a time, so that a batch pads little
    (1.3x faster at batch_size 64 than pieces in corpus order); ``alive(documents done, last piece)`` is
    called after each piece."""
    order = np.argsort([len(texts[j]) for j in range(start, end)], kind="stable")
    parts, long = [], 0
    for lo in range(0, end - start, PIECE):
        emb_part, long_part = encode([texts[start + j] for j in order[lo:lo + PIECE]])
        parts.append(emb_part)
        long += long_part
        alive(lo + emb_part.shape[0], lo + PIECE >= end - start)
    emb = np.empty((end - start, parts[0].shape[1]), dtype=parts[0].dtype)
    emb[order] = np.concatenate(parts)
    return emb, long


def _marker(work_dir: Path, i: int) -> dict:
    """A shard's completion marker: ``{"rows", "long_documents"}`` (older markers hold the row count only)."""
    text = done_marker(work_dir, i).read_text().strip()
    return json.loads(text) if text.startswith("{") else {"rows": int(text)}


def wait_for_shards(work_dir: Path, n_shards: int, timeout_s: float = 7 * 24 * 3600, poll_s: float = 5.0, *,
                    marker: str = "shard-{:06d}.done", stage: str = "embed") -> None:
    """Block until every shard's marker (``marker.format(i)`` in ``work_dir``) exists: other ranks may still
    be working on theirs (a file-system barrier).

    Raises:
        CcexpError: if they do not all appear within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not all((work_dir / marker.format(i)).is_file() for i in range(n_shards)):
        if time.monotonic() > deadline:
            raise CcexpError(f"{stage}: shards in {work_dir} did not all finish within {timeout_s:.0f} s; is a rank "
                             "down?")
        time.sleep(poll_s)


def assemble(work_dir: Path, n_docs: int, shard_size: int, out_path: Path) -> np.ndarray:
    """Concatenate the shards into one float16[N, d] ``.npy`` at ``out_path``; return it memory-mapped."""
    n_shards = -(-n_docs // shard_size)
    dim = np.load(shard_path(work_dir, 0), mmap_mode="r").shape[1]
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.float16, shape=(n_docs, dim))
    for i in range(n_shards):
        block = np.load(shard_path(work_dir, i), mmap_mode="r")
        out[i * shard_size:i * shard_size + block.shape[0]] = block
    out.flush()
    del out
    return np.load(out_path, mmap_mode="r")


def embed_and_assemble(encode: Callable[[list], tuple[np.ndarray, int]], items: list, out_path: Path,
                       work_dir: Path | None, *, shard_size: int, rank: int = 0,
                       world_size: int = 1) -> tuple[np.ndarray | None, dict]:
    """Embed this rank's shards of ``items`` ([`embed_shards`][ccexp.embedding.shards.embed_shards]), then — on rank 0, once every rank's
    shards are done — assemble float16[N, d] at ``out_path`` ([`assemble`][ccexp.embedding.shards.assemble]).

    Returns:
        the embeddings memory-mapped (None on other ranks) and [`embed_shards`][ccexp.embedding.shards.embed_shards]' statistics.
    """
    work_dir = Path(work_dir or Path(out_path).parent / "shards")
    stats = embed_shards(encode, items, work_dir, shard_size=shard_size, rank=rank, world_size=world_size)
    if rank != 0:
        return None, stats
    wait_for_shards(work_dir, -(-len(items) // shard_size))
    return assemble(work_dir, len(items), shard_size, Path(out_path)), stats
