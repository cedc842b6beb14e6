#!/usr/bin/env bash
# Ninth session, call F3: the speculative GPU tests whose verify steps take the few-row
# streaming GEMV (the 8B shape's layers, the 0.6B shape's LM head).
B="bash benchmarks/gpu_run.sh"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
TEST_TIMEOUT=150 TESTS="tests/test_gpu_spec_verify.py tests/test_spec_gpu.py tests/test_gpu_spec_drafters.py tests/test_spec_draft_graphs.py" $B pytests-each
