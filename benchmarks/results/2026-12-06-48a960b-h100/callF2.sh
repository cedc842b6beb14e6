#!/usr/bin/env bash
# Ninth session, call F2 (after F1 measured the few-row kernel slower): batch 1 on the 8B shape
# with that kernel off (SLIPSTREAM_GEMV_STREAM_ROWS=1: every 2-4-row product on cuBLAS, the
# code path of the tree once the kernel is removed), twice over: n-gram k = 3 at 3 tokens a
# step, EAGLE-3 k = 3 at 3.5, plain; then the draft-model curve (Llama-3.2-1B shape, k = 4,
# A = 2 and 4).
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
M="--gpu-memory-utilization 0.8"
OFF="SLIPSTREAM_GEMV_STREAM_ROWS=1"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
rm -rf /tmp/res; mkdir -p /tmp/res
REPS=2 WORKLOADS="seed-8b-bs1" ARMS="$OFF --speculative-config $N3 --spec-synthetic-accept 2;$OFF $M --speculative-config $E3 --spec-synthetic-accept 2.5;$OFF" bash benchmarks/gpu_run.sh ab-env > /dev/null 2>&1
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="$OFF $M --speculative-config $D4 --spec-synthetic-accept 2;$OFF $M --speculative-config $D4 --spec-synthetic-accept 4" bash benchmarks/gpu_run.sh ab-env > /dev/null 2>&1
for f in /tmp/res/ab-env-*.log; do echo "== ${f#/tmp/res/ab-env-seed-8b-bs1-}"; grep -E "^\| seed|speculation \(" "$f"; done
