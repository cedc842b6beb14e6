#!/usr/bin/env bash
# The fourth session's second device call, from the archived tree (.head) with ../.whl and
# ../.smoltok: the small MoE path's tiles at one row (kernel sweep, then the engine under
# SLIPSTREAM_MOE_SMALL_CONFIG), small-256 all / half constrained with 8 and 12 grammar workers
# beside plain small-256, then the MoE throughput workload and its transformers peer.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
export SLIPSTREAM_GEMV_MMA_ROWS=0  # (the 2-16-row GEMV is timed in a later call)
R=/tmp/res
(timeout 100 python3 benchmarks/bench_moe.py --small-variants --tokens 1 --out $R/moe-small.json > $R/moe-small.log 2>&1; echo "rc=$?" >> $R/moe-small.log)
REPS=1 WORKLOADS="moe-30b-a3b-bs1" ARMS="X=1;SLIPSTREAM_MOE_SMALL_CONFIG=down_block_n=4,num_warps=2;SLIPSTREAM_MOE_SMALL_CONFIG=down_block_n=4" $B ab-env
REPS=1 WORKLOADS="small-256" ARMS="X=1" $B ab-env
REPS=1 WORKLOADS="small-256-json" ARMS="X=1 $G --structured-outputs-workers 8;X=1 $G --structured-outputs-workers 12" $B ab-env
REPS=1 WORKLOADS="small-256-json-half" ARMS="X=1 $G --structured-outputs-workers 8" $B ab-env
$B moe moe-peer
tar -czf "$OUT/results.tgz" -C /tmp/res .
cd /tmp/res || exit 0
grep -h -E "^\| (small|seed|moe)" ab-*.log 2>/dev/null | cut -c1-150
grep -h -E "grammar CPU" ab-env-*.log 2>/dev/null | cut -c1-160
grep -E "^T=|small up 16x128 down 4|w2" moe-small.log | head -40
tail -5 moe.log moe-peer.log 2>/dev/null
