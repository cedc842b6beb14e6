#!/usr/bin/env bash
# Eighth session, call E5: with SmolLM2's GGUF assembled from the three carried parts (.smolA,
# .smolB in bare calls before, .smolC with this one), its n-gram figure on grounded prompts
# (with the step timeline), and the speculative GPU tests that need SmolLM2.
B="bash benchmarks/gpu_run.sh"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
SPEC_REAL_ARGS="--timeline" $B spec-real
TEST_TIMEOUT=120 TESTS="tests/test_gpu_spec.py tests/test_gpu_spec_verify.py tests/test_spec_ngram_graph_keys.py" $B pytests-each
