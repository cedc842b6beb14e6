#!/usr/bin/env bash
# Seventh session, call D3: moe-30b-a3b (256 requests) on the engine and on Hugging Face
# transformers' continuous batching with grouped_mm experts, same requests, same call; then the
# one-row MoE step with its o_proj (exactly 16 MiB) on the streaming GEMV against the default.
B="bash benchmarks/gpu_run.sh"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
MOE_ARGS="--mode async" timeout 130 bash benchmarks/gpu_run.sh moe
echo "=== moe-peer ($(date +%T))" >> $OUT/log.txt
timeout 230 bash benchmarks/peer_transformers.sh /tmp/res/moe-peer async --workload moe-30b-a3b > /tmp/res/moe-peer.log 2>&1
echo "=== moe-peer rc=$?" >> $OUT/log.txt; tail -n 30 /tmp/res/moe-peer.log >> $OUT/log.txt
tar -czf "$OUT/results.tgz" -C /tmp/res . 2>/dev/null
