#!/usr/bin/env bash
# Sixth session, call C3: the MoE throughput workload (Qwen3-30B-A3B shape, dummy weights) and
# Hugging Face transformers' continuous batching with grouped_mm experts on the same requests.
B="bash benchmarks/gpu_run.sh"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
MOE_ARGS="--mode async" $B moe moe-peer
