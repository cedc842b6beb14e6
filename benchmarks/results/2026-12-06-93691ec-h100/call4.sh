#!/usr/bin/env bash
# The fourth session's fourth device call, from the archived tree (.head) with ../.whl (now with
# llguidance) and ../.smoltok: small-256-json's grammar paths on one host beside plain small-256:
# in-line fill, the fill on a thread (SLIPSTREAM_GRAMMAR_FILL_THREAD=1), llguidance, 4 workers.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
export SLIPSTREAM_GEMV_MMA_ROWS=0  # (measured slower; being removed)
REPS=1 WORKLOADS="small-256" ARMS="X=1" $B ab-env
REPS=1 WORKLOADS="small-256-json" ARMS="X=1 $G --structured-outputs-workers 0;SLIPSTREAM_GRAMMAR_FILL_THREAD=1 $G --structured-outputs-workers 0;X=1 $G --structured-outputs-workers 0 --structured-outputs-backend llguidance;X=1 $G --structured-outputs-workers 4" $B ab-env
tar -czf "$OUT/results.tgz" -C /tmp/res .
cd /tmp/res || exit 0
grep -h -E "^\| (small|seed|moe)|grammar CPU" ab-*.log 2>/dev/null | cut -c1-150
grep -h -E "rror" ab-*.log | head -5
