#!/usr/bin/env bash
# Seventh session, call D1: batch 1 on the 8B shape with synthetic acceptance against plain
# (EAGLE-3 at 3.5 tokens a step with k = 4 and 3, n-gram at 3 tokens a step), where the EAGLE-3
# step's time goes (profile_bench), the runner's drafting GPU tests (upload_device_drafts
# refactor), profile_bench's GPU test, then the draft-model curve (Llama-3.2-1B shape, k = 4).
B="bash benchmarks/gpu_run.sh"
E4='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":4}'
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
M="--gpu-memory-utilization 0.8"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1;X=1 $M --speculative-config $E4 --spec-synthetic-accept 2.5;X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5;X=1 --speculative-config $N3 --spec-synthetic-accept 2" $B ab-env
WORKLOADS=seed-8b-bs1 PROFILE_ARGS="--mode async $M --speculative-config '$E4' --spec-synthetic-accept 2.5" $B profile-bench
TEST_TIMEOUT=100 TESTS="tests/test_gpu_spec_drafters.py tests/test_spec_gpu.py tests/test_profile_bench.py" $B pytests-each
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1 $M --speculative-config $D4 --spec-synthetic-accept 1;X=1 $M --speculative-config $D4 --spec-synthetic-accept 2;X=1 $M --speculative-config $D4 --spec-synthetic-accept 4" $B ab-env
