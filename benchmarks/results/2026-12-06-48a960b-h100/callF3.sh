#!/usr/bin/env bash
# Ninth session, call F3: the speculative GPU tests at this tree with the few-row kernel off
# (SLIPSTREAM_GEMV_STREAM_ROWS=1: the code path once it is removed), after 3b3e906's verify
# changes (never run on a GPU before).
B="bash benchmarks/gpu_run.sh"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} SLIPSTREAM_GEMV_STREAM_ROWS=1
TEST_TIMEOUT=140 TESTS="tests/test_gpu_spec_verify.py tests/test_spec_gpu.py tests/test_gpu_spec_drafters.py tests/test_spec_draft_graphs.py tests/test_spec_acceptance_kernel.py" $B pytests-each > /dev/null 2>&1
grep -E "^=== |passed|failed|error" $OUT/log.txt | tail -30
