#!/usr/bin/env bash
# Eighth session, call E1: batch 1 on the 8B shape, base tree 62d0b09 (.baseline) against this
# tree (the point-mass acceptance and the synthetic picks in one Triton kernel; a device
# drafter's drafts placed by the device-drafting kernels; the EAGLE-3 greedy argmax over the
# draft vocabulary), alternately: plain, EAGLE-3 k = 3 at A = 2.5 and at A = 3 (a whole A
# takes no hash), n-gram k = 3 at A = 2; then each tree once more (EAGLE-3 2.5, n-gram);
# then the GPU tests of the kernels and the drafters.
B="bash benchmarks/gpu_run.sh"
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
M="--gpu-memory-utilization 0.8"
$B env
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
ab() {  # ab TREE TAG ARMS
  (cd "$1" && PYTHONPATH=.:$PYTHONPATH REPS=1 WORKLOADS="seed-8b-bs1" ARMS="$3" bash benchmarks/gpu_run.sh ab-env)
  mkdir -p /tmp/res/$2; mv /tmp/res/ab-env-* /tmp/res/$2/
}
ALL="X=1;X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5;X=1 $M --speculative-config $E3 --spec-synthetic-accept 3;X=1 --speculative-config $N3 --spec-synthetic-accept 2"
TWO="X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5;X=1 --speculative-config $N3 --spec-synthetic-accept 2"
ab ../.baseline base1 "$ALL"
ab . new1 "$ALL"
ab ../.baseline base2 "$TWO"
ab . new2 "$TWO"
export PYTHONPATH=.:$PYTHONPATH
TEST_TIMEOUT=90 TESTS="tests/test_spec_acceptance_kernel.py tests/test_spec_device_drafts_kernel.py tests/test_gpu_spec_drafters.py tests/test_spec_gpu.py" $B pytests-each
