#!/usr/bin/env bash
# For the next session (not run): the MoE one-row step with its o_proj (exactly 16 MiB, on the
# whole-tile GEMV at ~2.0 TB/s in the PDL-off profile) moved to the streaming GEMV, against the
# default, twice alternately; then the MoE throughput workload and Hugging Face transformers'
# continuous batching with grouped_mm experts on the same requests, in one call.
B="bash benchmarks/gpu_run.sh"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=2 WORKLOADS="moe-30b-a3b-bs1" ARMS="X=1;SLIPSTREAM_GEMV_STREAM_MB=15" $B ab-env
MOE_ARGS="--mode async" $B moe moe-peer
