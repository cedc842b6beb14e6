#!/usr/bin/env bash
# Eighth session, call E3 (warm): the n-gram k = 3 (A = 2) and EAGLE-3 k = 3 (A = 2.5) steps
# under profile_bench, graphed (both slots captured); carries SmolLM2's first part.
B="bash benchmarks/gpu_run.sh"
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
M="--gpu-memory-utilization 0.8"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
WORKLOADS=seed-8b-bs1 PROFILE_ARGS="--mode async --speculative-config '$N3' --spec-synthetic-accept 2" $B profile-bench
mv /tmp/res/profile-seed-8b-bs1 /tmp/res/profile-ngram; mv /tmp/res/profile-seed-8b-bs1.log /tmp/res/profile-ngram.log
WORKLOADS=seed-8b-bs1 PROFILE_ARGS="--mode async $M --speculative-config '$E3' --spec-synthetic-accept 2.5" $B profile-bench
mv /tmp/res/profile-seed-8b-bs1 /tmp/res/profile-eagle; mv /tmp/res/profile-seed-8b-bs1.log /tmp/res/profile-eagle.log
