#!/usr/bin/env bash
# Eighth session, call E7: the draft-model curve at this tree (Llama-3.2-1B shape, k = 4,
# A = 2 and 4, beside plain): the device drafts now placed by the Triton kernels.
B="bash benchmarks/gpu_run.sh"
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
M="--gpu-memory-utilization 0.8"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1;X=1 $M --speculative-config $D4 --spec-synthetic-accept 2;X=1 $M --speculative-config $D4 --spec-synthetic-accept 4" $B ab-env
