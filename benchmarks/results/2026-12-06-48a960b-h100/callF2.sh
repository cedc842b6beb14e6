#!/usr/bin/env bash
# Ninth session, call F2: end to end at batch 1 on the 8B shape, the few-row streaming GEMV off
# (SLIPSTREAM_GEMV_STREAM_ROWS=1: cuBLAS) and on, in turn, twice: n-gram k = 3 at 3 tokens a
# step, EAGLE-3 k = 3 at 3.5; plain decoding once (no 2-4-row products: unchanged).
B="bash benchmarks/gpu_run.sh"
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
M="--gpu-memory-utilization 0.8"
OFF="SLIPSTREAM_GEMV_STREAM_ROWS=1"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=2 WORKLOADS="seed-8b-bs1" ARMS="$OFF --speculative-config $N3 --spec-synthetic-accept 2;X=1 --speculative-config $N3 --spec-synthetic-accept 2;$OFF $M --speculative-config $E3 --spec-synthetic-accept 2.5;X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5" $B ab-env
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1" $B ab-env
