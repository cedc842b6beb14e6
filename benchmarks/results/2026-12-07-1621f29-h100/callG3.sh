#!/usr/bin/env bash
# Tenth session, call G3 (1621f29; ../.baseline dbd25c1): G1's engine runs again with
# partial-json-parser carried: seed-8b-bs1-fp8 default, mma_block_k=512, mma_prefetch_k=1024;
# seed-8b-short-fp8 on dbd25c1 and 1621f29, seed-8b-short bf16.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/G3; mkdir -p $R
rm -rf /tmp/res; mkdir -p /tmp/res
t0=$(date +%s)
V=SLIPSTREAM_FP8_GEMV_CONFIG
REPS=1 WORKLOADS="seed-8b-bs1-fp8" ARMS="X=1;$V=mma_block_k=512;$V=mma_prefetch_k=1024" bash benchmarks/gpu_run.sh ab-env > /dev/null 2>&1
for f in /tmp/res/ab-env-*.log; do echo "== ${f#/tmp/res/ab-env-}"; grep -E "^\| seed|rror" "$f" | head -3; done
mkdir -p $R/ab; cp /tmp/res/ab-env-*.log $R/ab/ 2>/dev/null
echo "bs1 A/B $(( $(date +%s) - t0 )) s"
bench() {  # bench NAME DIR WORKLOAD
  t0=$(date +%s)
  (cd $2 && PYTHONPATH=/tmp/site:. timeout 150 python3 -m slipstream.cli bench --workload $3 --mode async --no-measure) > $R/$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| seed|^\| decode|^\| with|rror" $R/$1.log | head -6
}
bench short-fp8-base ../.baseline seed-8b-short-fp8
bench short-fp8-new . seed-8b-short-fp8
bench short-bf16 . seed-8b-short
tail -3 $OUT/G2/fp8-skinny.log 2>/dev/null
