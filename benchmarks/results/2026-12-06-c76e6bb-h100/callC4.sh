#!/usr/bin/env bash
# For the next session (not run): with SmolLM2's GGUF assembled from the three carried parts
# (.smolA, .smolB, then .smolC with this call; see the fifth session's A2-A4), its n-gram figure
# on grounded prompts after the host-cost fixes (with the step timeline), and the GPU tests that
# failed in C1 only for want of SmolLM2.
B="bash benchmarks/gpu_run.sh"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
SPEC_REAL_ARGS="--timeline" $B spec-real
TEST_TIMEOUT=150 TESTS="tests/test_gpu_spec.py tests/test_gpu_fp8.py tests/test_spec_ngram_graph_keys.py" $B pytests-each
