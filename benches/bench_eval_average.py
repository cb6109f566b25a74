"""What the averaged evaluation costs the default run: the EMA update after every optimizer step and
the one extra full held-out evaluation (the final weights are scored beside the averaged ones).

The default job's shape on the embedded corpus: the tiny GPT, 2,048 tokens per step (one micro-batch
of 16 rows of 128), 1,000 steps, a held-out curve of 128 documents every 100 steps and one full
held-out evaluation of every held-out document (``eval.max_tokens`` = ``train.seq_len`` = 128).
Rounds of plain steps and of steps followed by the EMA update (:class:`ccexp.training.callbacks.WeightAverage`,
the callback the run uses) alternate in one process, so other load on the machine hits both alike;
a full evaluation is timed with the run's own scorer (:func:`ccexp.evaluation.perplexity.document_nll`).
The run's cost is rebuilt from the same measurements (1,000 steps + 11 curve points + one full
evaluation) and the averaging's share of it is printed as a ratio (goal: at most 5 %).

Usage:
    python benches/bench_eval_average.py               # 6 rounds of 20 steps per side
    python benches/bench_eval_average.py --rounds 10
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data_path import ccexp_batches, load_corpus, train_steps  # noqa: E402

from ccexp.data.corpus import heldout_flags  # noqa: E402
from ccexp.evaluation.perplexity import document_nll  # noqa: E402
from ccexp.training.callbacks import WeightAverage  # noqa: E402
from ccexp.training.models import tiny_gpt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="the default run's optimizer steps")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=20, help="timed steps per side per round")
    args = ap.parse_args()
    tokens, offsets, labels, vocab, eos = load_corpus()
    held = np.flatnonzero(heldout_flags([str(i) for i in range(labels.size)], 0.05))
    torch.manual_seed(0)
    model = tiny_gpt(vocab, eos)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = ccexp_batches(tokens, offsets, labels, eos=eos, seq_len=128, tokens_per_step=2048, micro=16)
    module = SimpleNamespace(model=model)
    average = WeightAverage("ema", 0.1, args.steps)
    average.setup(None, module, "fit")
    step = [0]

    def ema_steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            train_steps(model, opt, batches, 1, 1)
            step[0] += 1
            average.on_train_batch_end(SimpleNamespace(global_step=step[0]), module, None, {"last_micro": True}, 0)
            times.append(time.perf_counter() - t0)
        return times

    train_steps(model, opt, batches, 5, 1)  # warm-up
    plain, ema = [], []
    for r in range(args.rounds):
        for side in (("plain", "ema") if r % 2 == 0 else ("ema", "plain")):
            if side == "plain":
                plain += train_steps(model, opt, batches, args.per_round, 1)
            else:
                ema += ema_steps(args.per_round)

    def score(docs: np.ndarray) -> float:
        t0 = time.perf_counter()
        document_nll(model, tokens, offsets, docs, eos_id=eos, pad_id=eos, max_tokens=128, batch_size=32)
        model.train()
        return time.perf_counter() - t0

    full = statistics.median(score(held) for _ in range(3))
    curve = statistics.median(score(held[:128]) for _ in range(3))
    step_plain, step_ema = statistics.median(plain), statistics.median(ema)
    run = args.steps * step_plain + 11 * curve + full  # the default run without averaging
    extra = args.steps * max(0.0, step_ema - step_plain) + full  # the EMA updates + scoring the final weights too
    print(f"held-out: {held.size} documents; median step {step_plain * 1e3:.1f} ms plain, {step_ema * 1e3:.1f} ms with "
          f"the EMA update ({len(plain)} steps each); full evaluation {full:.2f} s, curve point {curve:.2f} s")
    print(f"default run rebuilt: {run:.1f} s; averaging adds {extra:.1f} s: ratio {extra / run:.3f} (goal <= 0.05)")


if __name__ == "__main__":
    main()
