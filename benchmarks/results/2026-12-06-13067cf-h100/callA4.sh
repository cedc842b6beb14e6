#!/usr/bin/env bash
# Fifth session, call A4 (13067cf from .head; SmolLM2's GGUF assembled from the parts of
# calls A2-A4): the tests that need SmolLM2, its n-gram speculation figure (issue 45) and its
# FP8 accuracy table (issue 46).
B="bash benchmarks/gpu_run.sh"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
SPEC_REAL_ARGS="" $B spec-real fp8-accuracy
TEST_TIMEOUT=150 TESTS="tests/test_gpu_spec.py tests/test_gpu_spec_verify.py tests/test_gpu_fp8.py" $B pytests-each
tar -czf "$OUT/results.tgz" -C /tmp/res .
