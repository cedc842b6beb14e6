#!/usr/bin/env bash
# Seventh session, call D2: batch 1 on the 8B shape, EAGLE-3 with synthetic acceptance A = 2.5
# (3.5 tokens a step; the fractional picks hashed since 8c83690), base tree 8c83690 (.baseline)
# against this tree (an all-greedy step drafts argmaxes, keeps no q, accepts by the
# point-mass rule; the synthetic outcome from its draws), alternately, each beside its own plain run; then the EAGLE-3 k = 3 step
# under profile_bench, eager (its ranges split the step); the GPU tests of the drafting
# graphs; before them the few-row split-K probe, and n-gram k = 3 at A = 2,
# and EAGLE-3 k = 3 with few-row products split along K (SLIPSTREAM_SPLIT_K=8:4:8192).
B="bash benchmarks/gpu_run.sh"
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
M="--gpu-memory-utilization 0.8"
$B env
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
ab() {  # ab TREE TAG ARMS
  (cd "$1" && PYTHONPATH=.:$PYTHONPATH REPS=1 WORKLOADS="seed-8b-bs1" ARMS="$3" bash benchmarks/gpu_run.sh ab-env)
  mkdir -p /tmp/res/$2; mv /tmp/res/ab-env-* /tmp/res/$2/
}
ab ../.baseline base1 "X=1;X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5"
ab . new1 "X=1;X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5"
N3='{"method":"ngram","num_speculative_tokens":3}'
SK="SLIPSTREAM_SPLIT_K=8:4:8192"
ab . split "X=1 --speculative-config $N3 --spec-synthetic-accept 2;$SK --speculative-config $N3 --spec-synthetic-accept 2;$SK $M --speculative-config $E3 --spec-synthetic-accept 2.5"
export PYTHONPATH=.:$PYTHONPATH
timeout 150 python3 benchmarks/bench_fewrow_splitk.py --out /tmp/res > /tmp/res/fewrow.log 2>&1; tail -n 40 /tmp/res/fewrow.log >> $OUT/log.txt
WORKLOADS=seed-8b-bs1 PROFILE_ARGS="--mode async --enforce-eager $M --speculative-config '$E3' --spec-synthetic-accept 2.5" $B profile-bench
mv /tmp/res/profile-seed-8b-bs1 /tmp/res/profile-eager; mv /tmp/res/profile-seed-8b-bs1.log /tmp/res/profile-eager.log
TEST_TIMEOUT=80 TESTS="tests/test_spec_draft_graphs.py" $B pytests-each
