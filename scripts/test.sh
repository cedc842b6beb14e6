#!/usr/bin/env bash
# Sets up (scripts/setup.sh, quick when .venv is already set up) and runs the tests, in tiers:
#   bash scripts/test.sh           the full suite; what CI runs (.ci/run): ~11 minutes on two
#       cores (two pytest-xdist workers, one OpenMP thread each; then the `ray` tests on one)
#   bash scripts/test.sh --quick   the quick tier, for every change: under a minute of tests
#       on two cores; it leaves out the tests marked (pyproject.toml) `slow` (the transformers
#       oracle, or about 1 s and up), `ray`, `subprocess` (an engine core, server, TP worker or
#       CLI process) and `gpu`
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
# The tests' tensors are tiny: a second OpenMP thread costs more in hand-offs and spinning
# than it computes (tests/test_moe_model.py + test_gemma3.py, quick: 13.5 s with one thread,
# 63 s with two, on a loaded 2-core machine; a third of the CPU time); tests/conftest.py gives
# the full suite one thread too. An OMP_NUM_THREADS already set wins.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bash scripts/setup.sh
. .venv/bin/activate
# Only the pytest plugins the suite uses: pytest rewrites the asserts of every module of an
# auto-loaded plugin's distribution at each start (schemathesis, hypothesis, anyio: 335
# modules, ~2 s of CPU before the first test); a plugin named with -p has only its own
# module rewritten. schemathesis.pytest.plugin: tests/test_fuzz_server.py's parametrize.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
plugins=(-p pytest_timeout -p _hypothesis_pytestplugin -p schemathesis.pytest.plugin)
run() { python -m pytest "${plugins[@]}" -q "$@" ${args[@]+"${args[@]}"}; }
if [ ${#marks[@]} -gt 0 ]; then
    run -p xdist -n 2 "${marks[@]}"
    exit
fi
# The full suite: all but the `ray` tests on two workers, then those alone on one: their replica
# tests kill actor processes they find machine-wide and wait on replacements, which a second
# worker's load and processes upset (both failed beside it).  (5: no `ray` test among the
# arguments.)
rc=0
run -p xdist -n 2 -m "not ray" || rc=$?
run -m ray || { r=$?; [ $r -eq 5 ] || rc=$r; }
exit $rc
