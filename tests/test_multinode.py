"""Two nodes x one process on this machine: two torchrun processes, one per "node", meeting through torchrun's c10d
rendezvous on 127.0.0.1 (gloo on the CPU), against two ranks on one node (one torchrun) and one plain process.
The three train on the same token stream, log the same losses and held-out metrics and end with the same
checkpoint, bit for bit, and the embedding and tokenize shards spread over the two nodes' ranks give the arrays
one process computes. Only rank 0 writes the MLflow store, the checkpoints, the run's report files and the stage
store: checked under strace, not read off the code. The runs: tests/test_cases.py's TINY (debug=tiny: 20 steps
of 8 rows of 64 tokens on 300 documents, every step's loss logged), micro-batches of 4 rows (two per step in one
process, one per rank), shards of 50 documents (6 shards: ranks 0 and 1 take the even and the odd ones), one
thread per process.

The torchrun commands are those of docs/using.md, "Two nodes" (``python -m torch.distributed.run`` is torchrun)."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT

CASES = Path(__file__).parent / "cases"
TINY = ["debug=tiny", "data=jsonl", "data.label_fields=[domain]", "train.max_doc_tokens=64", "eval.max_tokens=63",
        f"data.path={CASES / 'tiny.jsonl'}", "train.micro_batch_size=4", "train.record_batches=true",
        "embedder.shard_size=50", "data.shard_documents=50", "trainer.precision=32-true", "trainer.threads=1",
        "train.log_every_n_steps=1"]
DDP = ["trainer=ddp", "trainer.accelerator=cpu"]
# the syscalls that create, open, rename or remove a file or folder
WRITES = "open,openat,openat2,creat,mkdir,mkdirat,rename,renameat,renameat2,link,linkat,symlink,symlinkat,unlink," \
         "unlinkat,rmdir,truncate"
STRACE = shutil.which("strace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    """The test's environment without any launcher's variables, and without OMP_NUM_THREADS: trainer.threads alone
    must hold the threads (Lightning's DDP launcher would otherwise set every core in each process)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")
    return {**{k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")},
            "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                     os.environ.get("PYTHONPATH")]))}


def torchrun(nnodes: int, nproc: int, port: int, rdzv_id: str, *overrides: str, node_rank: int | None = None
             ) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            *([] if node_rank is None else [f"--node-rank={node_rank}"]), "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}", "-m", "ccexp", *overrides]


def start(cmd: list[str], cwd: Path, log: Path, trace: Path | None = None) -> subprocess.Popen:
    """``cmd`` in ``cwd`` (its own folder: a node's working directory), stdout and stderr to ``log``; under strace
    (every process it starts, successful calls only, file descriptors as paths) when ``trace`` is given."""
    cwd.mkdir(parents=True, exist_ok=True)
    if trace is not None:
        cmd = [STRACE, "-f", "-qq", "-z", "-y", "--seccomp-bpf", "-e", f"trace={WRITES}", "-e", "signal=none", "-o",
               str(trace), *cmd]
    return subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> list[str]:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [log.read_text() for log in logs]


def two_nodes(root: Path, *overrides: str, trace: bool = False) -> tuple[list[subprocess.Popen], list[Path]]:
    """Start the two "nodes": two torchrun agents, each in its own working directory, meeting at one rendezvous
    (c10d ranks the nodes as they join, whatever --node-rank says)."""
    port = free_port()
    procs, logs = [], []
    for n in (0, 1):
        logs.append(root / f"node{n}.log")
        procs.append(start(torchrun(2, 1, port, f"two-{port}", *overrides, node_rank=n), root / f"node{n}", logs[-1],
                           root / f"trace{n}.txt" if trace else None))
    return procs, logs


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> dict:
    """The same run three ways, one after the other, each with its own paths.outputs (each computes its own stages):
    ``single`` (python -m ccexp), ``one_node`` (torchrun, 1 node x 2 processes), ``two_nodes`` (2 torchruns x 1
    process, under strace when it is installed); their outputs folders, node logs and wall seconds."""
    root = tmp_path_factory.mktemp("multinode")
    ways: dict = {}
    t0 = time.perf_counter()
    log = root / "single.log"
    proc = start([sys.executable, "-m", "ccexp", *TINY, f"paths.outputs={root / 'single'}"], root / "single-cwd", log)
    ways["single"] = {"out": root / "single", "logs": finish([proc], [log]), "seconds": time.perf_counter() - t0}
    t0, port = time.perf_counter(), free_port()
    log = root / "one_node.log"
    proc = start(torchrun(1, 2, port, f"one-{port}", *DDP, "trainer.num_nodes=1", "trainer.devices=2", *TINY,
                          f"paths.outputs={root / 'one_node'}"), root / "one-cwd", log)
    ways["one_node"] = {"out": root / "one_node", "logs": finish([proc], [log]), "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    procs, logs = two_nodes(root, *DDP, "trainer.num_nodes=2", "trainer.devices=1", *TINY,
                            f"paths.outputs={root / 'two_nodes'}", trace=STRACE is not None)
    ways["two_nodes"] = {"out": root / "two_nodes", "logs": finish(procs, logs), "seconds": time.perf_counter() - t0,
                         "traces": [root / "trace0.txt", root / "trace1.txt"] if STRACE else None}
    for name, way in ways.items():
        print(f"multinode: {name} took {way['seconds']:.0f} s")
        for text in way["logs"]:
            assert "done: " in text or "GLOBAL_RANK: 1" in text, f"{name}:\n{text[-3000:]}"
    for p in procs:
        assert p.returncode == 0, "\n".join(text[-2000:] for text in ways["two_nodes"]["logs"])
    return ways


def run_dir(out: Path) -> Path:
    (found,) = out.glob("runs/*/*/run.json")
    return found.parent


def mlflow_run(out: Path):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])
    return client, run


def rows(out: Path) -> dict:
    """{(step, row): (input_ids, doc_ids)} over every rank's recorded micro-batches, and each rank's rows."""
    found, ranks = {}, {}
    for path in sorted((run_dir(out) / "batches").glob("rank*.npz")):
        z = np.load(path)
        ranks[path.stem] = sorted({int(r) for rs in z["rows"] for r in rs})
        for t, rs, ids, docs in zip(z["steps"], z["rows"], z["input_ids"], z["doc_ids"]):
            found.update({(int(t), int(r)): (i, d) for r, i, d in zip(rs, ids, docs)})
    return found, ranks


WAYS = ("one_node", "two_nodes")


@pytest.mark.slow
def test_the_three_ways_train_on_the_same_token_stream(three):
    single, ranks = rows(three["single"]["out"])
    assert ranks == {"rank0": list(range(8))} and set(single) == {(t, r) for t in range(20) for r in range(8)}
    digests = {mlflow_run(three[w]["out"])[1].data.tags["stream_digest"] for w in ("single", *WAYS)}
    assert len(digests) == 1
    for way in WAYS:
        found, ranks = rows(three[way]["out"])
        assert ranks == {"rank0": [0, 1, 2, 3], "rank1": [4, 5, 6, 7]}  # each rank its contiguous half of every step
        assert found.keys() == single.keys()
        assert all(np.array_equal(found[k][0], single[k][0]) and np.array_equal(found[k][1], single[k][1])
                   for k in single)  # the same tokens of the same documents in the same rows


@pytest.mark.slow
def test_the_three_ways_log_the_same_losses_and_held_out_metrics(three):
    client, run = mlflow_run(three["single"]["out"])
    losses = [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"),
                                                 key=lambda m: m.step)]
    assert len(losses) == 20
    scores = {k: v for k, v in run.data.metrics.items() if k.startswith(("eval/", "curve/")) or k == "train/tokens"}
    assert "eval/ppl" in scores and "eval/ppl_macro" in scores and "curve/ppl" in scores
    for way in WAYS:
        client, other = mlflow_run(three[way]["out"])
        assert [(m.step, m.value) for m in sorted(client.get_metric_history(other.info.run_id, "train/loss"),
                                                  key=lambda m: m.step)] == losses  # every step's loss, exactly
        assert {k: other.data.metrics[k] for k in scores} == scores  # held-out and curve metrics, exactly


@pytest.mark.slow
def test_the_three_ways_end_with_the_same_checkpoint(three):
    import torch

    def state(way):
        return torch.load(run_dir(three[way]["out"]) / "checkpoints" / "last.ckpt", map_location="cpu",
                          weights_only=True)

    single = state("single")
    assert single["global_step"] == 20
    for way in WAYS:
        other = state(way)
        assert other["state_dict"].keys() == single["state_dict"].keys()
        assert all(torch.equal(other["state_dict"][k], single["state_dict"][k]) for k in single["state_dict"])
        adam, adam1 = other["optimizer_states"][0]["state"], single["optimizer_states"][0]["state"]
        assert all(torch.equal(adam[p][k], adam1[p][k]) for p in adam1 for k in adam1[p])  # AdamW's moments too


@pytest.mark.slow
def test_embedding_and_tokenize_shards_spread_over_two_nodes_match_one_process(three):
    def arrays(way):
        cache = three[way]["out"] / "cache"
        (emb,) = cache.glob("embed/*/embeddings.npy")
        (tok,) = cache.glob("tokenize/*/tokens.npy")
        return np.load(emb), np.load(tok)

    emb, tok = arrays("single")
    assert emb.shape == (300, 384) and emb.dtype == np.float16
    for way in WAYS:
        emb2, tok2 = arrays(way)
        assert np.array_equal(emb2, emb) and np.array_equal(tok2, tok)  # float16 bit for bit, tokens exactly
    folder = run_dir(three["two_nodes"]["out"])
    # ranks other than 0 keep ccexp's info lines off the console: rank 1's are in its own log only
    rank0, rank1 = (folder / "ccexp.log").read_text(), (folder / "ccexp-rank1.log").read_text()
    console1 = next(text for text in three["two_nodes"]["logs"] if "GLOBAL_RANK: 1" in text)
    assert "embed: shard" not in console1 and "tokenize: shard" not in console1
    # each node's rank embedded and tokenized its 3 of the 6 shards
    assert "embed: shard 3/3 (rank 1)" in rank1 and "embed: shard 3/3 (rank 0)" in rank0
    assert "tokenize: shard 3/3 (rank 1)" in rank1 and "tokenize: shard 3/3 (rank 0)" in rank0
    assert "shard 4/" not in rank0 + rank1


@pytest.mark.slow
def test_the_run_is_recorded_once_by_rank_0(three):
    out = three["two_nodes"]["out"]
    folder = run_dir(out)
    client, run = mlflow_run(out)  # one MLflow run, FINISHED, and run.json names it
    assert run.info.status == "FINISHED" and f'"mlflow_run_id": "{run.info.run_id}"' in (folder / "run.json").read_text()
    assert (folder / ".hydra" / "config.yaml").is_file() and [p.name for p in folder.glob(".*")] == [".hydra"]
    own, other = (folder / "ccexp.log").read_text(), (folder / "ccexp-rank1.log").read_text()
    assert "(rank 0)" in own and "(rank 1)" not in own and "mlflow: run" in own and "done: " in own
    assert "(rank 1)" in other and "(rank 0)" not in other and "mlflow" not in other  # rank 1 logs to its own file
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["last.ckpt"]


def writes(trace: Path, cwd: Path) -> list[tuple[str, str]]:
    """(call, absolute path) of every successful call in an strace log (``-f -y``) that created, opened for writing,
    renamed (both paths) or removed a file or folder; ``cwd``: the traced processes' working directory."""
    found, pending = [], {}
    for line in trace.read_text().splitlines():
        pid, _, text = line.partition(" ")
        if text.endswith("<unfinished ...>"):  # another thread's call came in between: joined when it resumes
            pending[pid] = text[:-len("<unfinished ...>")]
            continue
        resumed = re.match(r" *<\.\.\. \w+ resumed>(.*)", text)
        if resumed:
            text = pending.pop(pid, "") + resumed.group(1)
        m = re.match(r" *(\w+)\((.*)\) += \d+(?:<([^>]*)>)?$", text)
        if not m:
            continue
        call, args, opened = m.groups()
        if call.startswith("open") and not re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND", args):
            continue
        if opened:  # the file an open call returned, as strace -y resolves it
            found.append((call, opened))
            continue
        for _, base, name in re.findall(r'(?:(AT_FDCWD|\d+)<([^>]*)>, )?"([^"]*)"', args):
            found.append((call, name if name.startswith("/") else str(Path(base or cwd) / name)))
    return found


@pytest.mark.slow
@pytest.mark.skipif(STRACE is None, reason="needs strace (apt-get install -y strace)")
def test_under_strace_rank_1_writes_only_its_shards_its_batches_and_its_log(three):
    out = three["two_nodes"]["out"]
    folder = run_dir(out)
    logs, traces = three["two_nodes"]["logs"], three["two_nodes"]["traces"]
    node1 = next(n for n in (0, 1) if "GLOBAL_RANK: 1" in logs[n])  # c10d ranks the nodes as they join
    cwd = Path(traces[node1]).parent / f"node{node1}"
    mine = {(c, p) for c, p in writes(traces[node1], cwd) if p.startswith(str(out))}
    rel = folder.relative_to(out).as_posix()
    allowed = [  # what the design has every rank write: its share of the sharded stages' work files, its own
        # micro-batch record and log, and the (shared) run folder that Hydra makes on every rank before the job
        r"cache/embed/\.work-[0-9a-f]+/\.?shard-00000[135](\.\d+)?\.(npy|done)",
        r"cache/tokenize/\.work-[0-9a-f]+-s50/\.?(tokens|lengths)-00000[135](\.\d+)?\.(npy|done)",
        rf"{rel}/ccexp-rank1\.log", rf"{rel}/batches/rank1\.npz"]
    folders = {"", "cache", "cache/embed", "runs", f"{rel}/batches",
               *("/".join(rel.split("/")[:i]) for i in range(1, 4))}
    unexplained = sorted((c, p) for c, p in mine if not any(re.fullmatch(a, p[len(str(out)) + 1:]) for a in allowed)
                         and not (c.startswith("mkdir") and (p[len(str(out)) + 1:] in folders
                                                             or re.fullmatch(r"cache/embed/\.work-[0-9a-f]+",
                                                                             p[len(str(out)) + 1:]))))
    assert not unexplained, unexplained
    assert sum(p.endswith(".done") for _, p in mine) == 6  # 3 embedding and 3 tokenize shards
    # and the tracer sees what rank 0 writes: the MLflow store, the checkpoint, run.json, the stages' folders
    theirs = {p for _, p in writes(traces[1 - node1], Path(traces[1 - node1]).parent / f"node{1 - node1}")}
    for path in (out / "mlflow.db", folder / "checkpoints" / "last.ckpt", folder / "run.json",
                 folder / "tables" / "clusters.csv", folder / ".hydra" / "config.yaml", folder / "ccexp.log"):
        assert str(path) in theirs, path
    assert {p.split("/cache/")[1].split("/")[0] for p in theirs if "/cache/" in p and "/.tmp-" in p} >= {
        "corpus", "tokenize", "embed", "cluster"}  # every stage published by rank 0 (from a temporary folder)


def test_two_nodes_with_a_trainer_for_one_stop_before_any_stage(tmp_path):
    """The likely slip on two nodes: trainer.num_nodes left at 1. Every rank stops in pre-flight with one line
    naming the settings that match torchrun's launch, before any stage (Lightning would refuse it only at fit)."""
    procs, logs = two_nodes(tmp_path, *DDP, "trainer.devices=1", *TINY, f"paths.outputs={tmp_path / 'out'}")
    texts = finish(procs, logs, timeout=300)
    for p, text in zip(procs, texts):
        assert p.returncode != 0
        lines = [ln for ln in text.splitlines() if ln.startswith("ccexp: error:")]
        assert lines == ["ccexp: error: trainer.devices=1 x trainer.num_nodes=1 is 1 rank(s), but torchrun started 2 "
                         "(2 node(s) x 1 process(es)); use trainer.devices=1 trainer.num_nodes=2"], text[-3000:]
    assert not (tmp_path / "out" / "cache").exists()


def test_the_commands_in_the_docs_are_the_ones_tested():
    """docs/using.md's "Two nodes" commands are this file's launches (less the free port, the rendezvous id and
    the temporary outputs folders the test gives each)."""
    import shlex

    text = (ROOT / "docs" / "using.md").read_text()
    start = text.index("### Two nodes")
    end = text.find("\n### ", start + 1)
    section = re.sub(r"\\\n\s*", " ", text[start:end if end > 0 else len(text)])
    documented = [shlex.split(line) for line in re.findall(r"^(?:torchrun|\.venv/bin/python) .*$", section, re.M)]

    def norm(args: list[str]) -> list[str]:
        keep = [a for a in args if not a.startswith(("paths.outputs=", "--rdzv-endpoint=", "--rdzv-id="))]
        return sorted(a.replace(str(CASES / "tiny.jsonl"), "tests/cases/tiny.jsonl") for a in keep)

    tested = [torchrun(1, 2, 0, "", *DDP, "trainer.num_nodes=1", "trainer.devices=2", *TINY)[3:],
              ["-m", "ccexp", *TINY],
              *(torchrun(2, 1, 0, "", *DDP, "trainer.num_nodes=2", "trainer.devices=1", *TINY, node_rank=n)[3:]
                for n in (0, 1))]
    assert [norm(args[1:]) for args in documented if "-m" in args] == [norm(args) for args in tested]
    assert all("--rdzv-endpoint=127.0.0.1:29500" in args for args in documented if args[0] == "torchrun")
