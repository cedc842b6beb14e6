#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite; this is what CI runs.
# GPU-only tests are marked `gpu` and skipped without a GPU; Triton kernels run on the
# CPU through TRITON_INTERPRET=1 (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
