#!/usr/bin/env bash
# Sixth session, call C2 (the device time left after C1: ~230 s): batch 1 on the 8B shape with
# synthetic acceptance against plain: EAGLE-3 at 3.5 tokens a step (k = 4, accept 2.5) and the
# draft model (Llama-3.2-1B shape, k = 4, accept 3).
B="bash benchmarks/gpu_run.sh"
E4='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":4}'
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
M="--gpu-memory-utilization 0.8"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1;X=1 $M --speculative-config $E4 --spec-synthetic-accept 2.5;X=1 $M --speculative-config $D4 --spec-synthetic-accept 3" $B ab-env
