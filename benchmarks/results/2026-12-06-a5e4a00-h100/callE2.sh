#!/usr/bin/env bash
# Eighth session, call E2 (warm after E1): this tree, plain / EAGLE-3 k = 3 A = 2.5 / n-gram k = 3 A = 2 in turn, three
# times; then the remaining speculative GPU tests.
B="bash benchmarks/gpu_run.sh"
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
M="--gpu-memory-utilization 0.8"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=3 WORKLOADS="seed-8b-bs1" ARMS="X=1;X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5;X=1 --speculative-config $N3 --spec-synthetic-accept 2" $B ab-env
mkdir -p /tmp/res/new3; mv /tmp/res/ab-env-* /tmp/res/new3/
TEST_TIMEOUT=100 TESTS="tests/test_gpu_spec.py tests/test_gpu_spec_verify.py tests/test_spec_draft_graphs.py" $B pytests-each
