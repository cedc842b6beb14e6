#!/usr/bin/env bash
# Ninth session, call F6 (81ddf2a): batch 1 on the 8B shape with the bench's warm-up running a
# speculative latency workload to its full length (its graphs captured before the timed run):
# the draft model k = 4 at A = 4, n-gram k = 3 at A = 2, plain, one run each (the device time
# left allowed no more).
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
M="--gpu-memory-utilization 0.8"
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
rm -rf /tmp/res; mkdir -p /tmp/res
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1 $M --speculative-config $D4 --spec-synthetic-accept 4;X=1 --speculative-config $N3 --spec-synthetic-accept 2;X=1" bash benchmarks/gpu_run.sh ab-env > /dev/null 2>&1
for f in /tmp/res/ab-env-*.log; do echo "== ${f#/tmp/res/ab-env-seed-8b-bs1-}"; grep -E "^\| seed|speculation \(" "$f"; done
