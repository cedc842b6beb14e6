#!/usr/bin/env bash
# Ninth session, call F5 (warm): the draft-model step at k = 4, A = 4 (5 tokens a step) under
# profile_bench: where its extra ~3.6 ms of GPU and ~3.7 ms of CPU a step against A = 2 go.
B="bash benchmarks/gpu_run.sh"
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
M="--gpu-memory-utilization 0.8"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} SLIPSTREAM_GEMV_STREAM_ROWS=1
rm -rf /tmp/res; mkdir -p /tmp/res
WORKLOADS=seed-8b-bs1 PROFILE_ARGS="--mode async $M --speculative-config '$D4' --spec-synthetic-accept 4" $B profile-bench > /dev/null 2>&1
tail -60 /tmp/res/profile-seed-8b-bs1.log
