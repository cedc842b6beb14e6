#!/usr/bin/env bash
# Sets up (scripts/setup.sh, quick when .venv is already set up) and runs the tests, in tiers:
#   bash scripts/test.sh           the full suite; what CI runs (.ci/run)
#   bash scripts/test.sh --quick   the quick tier, for every change: under a minute of tests
#       on two cores; it leaves out the tests marked (pyproject.toml) `slow` (the
#       transformers oracle, or about 1 s and up), `ray`, `subprocess` (an engine core, server, TP
#       worker or CLI process) and `gpu`
# Other arguments go to pytest: bash scripts/test.sh --quick tests/test_sampler.py -x
# GPU-only tests are marked `gpu` and skipped without a GPU; Triton kernels run on the
# CPU through TRITON_INTERPRET=1 (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK="not slow and not ray and not subprocess and not gpu"
args=()
marks=()
for a in "$@"; do
    if [ "$a" = --quick ]; then marks=(-m "$QUICK"); else args+=("$a"); fi
done
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q ${marks[@]+"${marks[@]}"} ${args[@]+"${args[@]}"}
