#!/usr/bin/env bash
# Ninth session, call F4: with SmolLM2's GGUF assembled from the carried parts, the speculative
# GPU tests that need it, the few-row kernel off (SLIPSTREAM_GEMV_STREAM_ROWS=1).
B="bash benchmarks/gpu_run.sh"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} SLIPSTREAM_GEMV_STREAM_ROWS=1
TEST_TIMEOUT=150 TESTS="tests/test_gpu_spec_verify.py tests/test_gpu_spec.py tests/test_spec_ngram_graph_keys.py" $B pytests-each > /dev/null 2>&1
grep -E "^=== |passed|failed|error" $OUT/log.txt | tail -30
