#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (about 6-8 minutes after setup): prints figures.
#   1. trainer=gpu: 50 optimizer steps of the default job's model (tokens/s)
#   2. trainer=fsdp on 1 device: 10 steps of SmolLM2-135M (decoder-layer wrap, bf16-true)
#   3. FAISS k-means on GPU vs CPU at 200k x 384 (K=1000, 10 iterations): seconds and ratio
#   4. MiniLM encode on cuda vs CPU (docs/s and ratio)
# Usage: ./scripts/setup.sh && benches/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-/tmp/ccexp_gpu_check}
mkdir -p "$OUT"
nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU visible"; exit 1; }
export PYTHONWARNINGS=ignore
echo "== 1. trainer=gpu, 50 steps"
timeout 240 $PY -m ccexp trainer=gpu train.steps=50 eval.every_n_steps=null eval=default paths.outputs="$OUT/gpu" \
  2>&1 | grep -E "train: step 50|done:|ccexp:|Error" | tail -3
echo "== 2. trainer=fsdp, 1 device, SmolLM2-135M, 10 steps"
timeout 300 $PY -m ccexp +recipe=smollm2_135m trainer=fsdp trainer.devices=1 train.steps=10 train.tokens_per_step=8192 \
  train.seq_len=512 train.micro_batch_size=4 eval=default eval.every_n_steps=null paths.outputs="$OUT/fsdp" \
  2>&1 | grep -E "fsdp:|train: step 10|eval: held-out|done:|ccexp:|Error" | tail -6
echo "== 3. FAISS k-means GPU vs CPU, 200k x 384, K=1000, 10 iterations; 4. MiniLM encode cuda vs cpu"
timeout 300 $PY - <<'PY'
import time, numpy as np, faiss, torch
x = np.random.default_rng(0).normal(size=(200_000, 384)).astype(np.float32)
x /= np.linalg.norm(x, axis=1, keepdims=True)
t = {}
for gpu in (True, False):
    km = faiss.Kmeans(384, 1000, niter=10, seed=0, spherical=True, gpu=gpu, max_points_per_centroid=200)
    t0 = time.perf_counter(); km.train(x); t[gpu] = time.perf_counter() - t0
print(f"faiss k-means: gpu {t[True]:.1f} s, cpu {t[False]:.1f} s, cpu/gpu {t[False] / t[True]:.1f}x "
      f"(faiss GPUs: {faiss.get_num_gpus()})")
from ccexp.embedding.sentence import SentenceEmbedder
import gzip, json
from ccexp.data.corpus import BUILTIN_PATH
texts = [json.loads(l)["text"] for l in gzip.open(BUILTIN_PATH, "rt")][:4000]
rate = {}
for dev in ("cuda", "cpu"):
    e = SentenceEmbedder(device=dev, batch_size=128)
    e.encode(texts[:256])
    n = len(texts) if dev == "cuda" else 1000
    t0 = time.perf_counter(); e.encode(texts[:n]); rate[dev] = n / (time.perf_counter() - t0)
print(f"minilm encode: cuda {rate['cuda']:.0f} docs/s, cpu {rate['cpu']:.0f} docs/s, cuda/cpu {rate['cuda'] / rate['cpu']:.1f}x")
PY
