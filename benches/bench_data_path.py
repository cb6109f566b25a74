"""The training data path's cost: ccexp's token stream against a plain DataLoader, same model, same run.

ccexp's path is the policy's document stream (ClusterClip here) packed into the global token stream,
a step's rows dealt to the rank and cut into micro-batches (:class:`ccexp.training.data.SamplerDataModule`).
The baseline is the plain way: the whole corpus pre-packed once into rows of ``seq_len + 1`` tokens,
served by ``torch.utils.data.DataLoader(shuffle=True)``. Both feed the same training loop (the tiny GPT,
AdamW, gradient accumulation) on the embedded corpus; rounds of the two alternate in one process so
that other load on the machine hits both alike, and the median step times are compared as a ratio.

Then the peak memory of training (max RSS of a fresh process per setting, which loads the tokenized
corpus from a file, so the tokenizer's own peak does not mask it) as ``tokens_per_step`` grows 8x at
a fixed ``micro_batch_size`` — the budget adds micro-batches (accumulation), not memory — against the
same 8x pushed through one forward pass (``micro_batch_size`` 8x), which shows what the measure sees.

Usage:
    python benches/bench_data_path.py                   # 2,048 tokens/step, 60 steps per side
    python benches/bench_data_path.py --steps 200 --rounds 10
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ccexp.data.corpus import BUILTIN_PATH, read_corpus
from ccexp.data.packing import TokenStream
from ccexp.data.tokenize import encode_corpus, train_bpe_tokenizer
from ccexp.sampling import ClusterClipSampler
from ccexp.training.data import SamplerDataModule
from ccexp.training.models import tiny_gpt


def load_corpus(vocab: int = 4096):
    """The embedded corpus, tokenized with a locally trained BPE; clusters = its domains."""
    corpus = read_corpus(BUILTIN_PATH, format="auto", text_field="text", id_field="id", label_fields=["domain"])
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_bpe_tokenizer(corpus.texts, vocab, Path(tmp))
    tokens, offsets = encode_corpus(tok, corpus.texts)
    domains, labels = np.unique(np.asarray(corpus.labels["domain"]), return_inverse=True)
    return tokens, offsets, labels.astype(np.int32), len(tok), tok.eos_token_id


def ccexp_batches(tokens, offsets, labels, *, eos, seq_len, tokens_per_step, micro):
    """ccexp's data path: ClusterClip -> token stream -> this rank's micro-batches (one process)."""
    sizes = np.bincount(labels).astype(np.int64)
    doc_tokens = np.diff(offsets)
    rows = tokens_per_step // seq_len
    sampler = ClusterClipSampler(labels, sizes, block_size=max(1, tokens_per_step // int(doc_tokens.mean() + 1)),
                                 clip_threshold=5, on_exhausted="reset")
    stream = TokenStream(sampler, doc_tokens, seq_len=seq_len, rows_per_step=rows)
    dm = SamplerDataModule(stream, np.arange(labels.size), tokens, offsets, total_steps=10**6, micro_batch_size=micro,
                           grad_accumulation=rows // micro, eos_id=eos)
    for batch in dm.train_dataloader():
        yield batch["input_ids"], batch["labels"]


def baseline_batches(tokens, offsets, *, eos, seq_len, micro, seed=0):
    """The plain way: the corpus packed once (documents in a random order, EOS between them) into rows
    of seq_len + 1 tokens, shuffled by a DataLoader, forever."""
    order = np.random.default_rng(seed).permutation(offsets.size - 1)
    pieces = [np.concatenate([[eos], tokens[offsets[d]:offsets[d + 1]]]) for d in order]
    flat = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
    n = (flat.numel() - 1) // seq_len
    rows = torch.stack([flat[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=micro, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(seed))
    while True:
        for (batch,) in loader:
            yield batch[:, :-1], batch[:, 1:]


def train_steps(model, opt, batches, steps: int, accumulation: int) -> list[float]:
    """The same loop for both paths; returns the wall time of each optimizer step (seconds)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(accumulation):
            inputs, labels = next(batches)
            logits = model(input_ids=inputs, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) / accumulation
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def time_comparison(args) -> None:
    tokens, offsets, labels, vocab, eos = load_corpus()
    accumulation = args.tokens_per_step // (args.seq_len * args.micro_batch_size)
    print(f"corpus: {labels.size:,} documents, {tokens.size:,} tokens, {labels.max() + 1} clusters (domains); "
          f"step = {args.tokens_per_step:,} tokens = {accumulation} micro-batch(es) of {args.micro_batch_size} x "
          f"{args.seq_len}; torch threads {torch.get_num_threads()}")
    torch.manual_seed(0)
    model = tiny_gpt(vocab, eos)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    paths = {"baseline": baseline_batches(tokens, offsets, eos=eos, seq_len=args.seq_len, micro=args.micro_batch_size),
             "ccexp": ccexp_batches(tokens, offsets, labels, eos=eos, seq_len=args.seq_len,
                                    tokens_per_step=args.tokens_per_step, micro=args.micro_batch_size)}
    for name, batches in paths.items():  # warm-up: caches, allocator, first plans
        train_steps(model, opt, batches, 5, accumulation)
    per_step: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(args.rounds):
        for name in (paths if r % 2 == 0 else reversed(list(paths))):  # alternate the order of the two
            per_step[name] += train_steps(model, opt, paths[name], args.steps // args.rounds, accumulation)
    data_only = {}
    for name, batches in paths.items():
        t0 = time.perf_counter()
        for _ in range(200):
            next(batches)
        data_only[name] = (time.perf_counter() - t0) / 200
    med = {name: statistics.median(t) for name, t in per_step.items()}
    for name in paths:
        print(f"{name:9s} median step {med[name] * 1e3:7.2f} ms ({len(per_step[name])} steps), "
              f"data alone {data_only[name] * 1e3:6.3f} ms per micro-batch")
    print(f"step time ratio ccexp / baseline: {med['ccexp'] / med['baseline']:.3f} (goal <= 1.02)")


def child_peak(args) -> None:
    """In a fresh process: train ``--steps`` steps through ccexp's path, print the peak RSS (MiB)."""
    z = np.load(args.child)
    tokens, offsets, labels, vocab, eos = z["tokens"], z["offsets"], z["labels"], int(z["vocab"]), int(z["eos"])
    torch.manual_seed(0)
    model = tiny_gpt(vocab, eos)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accumulation = args.tokens_per_step // (args.seq_len * args.micro_batch_size)
    batches = ccexp_batches(tokens, offsets, labels, eos=eos, seq_len=args.seq_len, tokens_per_step=args.tokens_per_step,
                            micro=args.micro_batch_size)
    train_steps(model, opt, batches, args.steps, accumulation)
    print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def memory_sweep(args) -> None:
    tokens, offsets, labels, vocab, eos = load_corpus()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "corpus.npz"
        np.savez(data, tokens=tokens, offsets=offsets, labels=labels, vocab=vocab, eos=eos)

        def peak(tokens_per_step: int, micro: int) -> float:
            cmd = [sys.executable, __file__, "--child", str(data), "--tokens-per-step", str(tokens_per_step),
                   "--micro-batch-size", str(micro), "--seq-len", str(args.seq_len), "--steps", "6"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ}).stdout
            return json.loads(out.strip().splitlines()[-1])["peak_mib"]

        m, base = args.mem_micro_batch_size, args.seq_len * args.mem_micro_batch_size
        fixed, grown = {}, {}
        for factor in (1, 2, 4, 8):
            fixed[factor] = peak(base * factor, m)
            grown[factor] = peak(base * factor, m * factor)
            print(f"tokens_per_step {base * factor:6,d}: micro_batch_size {m} x {factor} accumulation: peak RSS "
                  f"{fixed[factor]:7.1f} MiB | one forward of {m * factor} rows: {grown[factor]:7.1f} MiB", flush=True)
    print(f"peak memory at 8x the token budget / at 1x: fixed micro-batch {fixed[8] / fixed[1]:.3f} (flat = 1.00); "
          f"8x micro-batch {grown[8] / grown[1]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens-per-step", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per path")
    ap.add_argument("--rounds", type=int, default=6, help="alternations of the two paths")
    ap.add_argument("--mem-micro-batch-size", type=int, default=16)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the tokenized corpus (.npz) of a child
    args = ap.parse_args()
    if args.child:
        child_peak(args)
        return
    time_comparison(args)
    memory_sweep(args)


if __name__ == "__main__":
    main()
