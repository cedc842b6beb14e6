#!/usr/bin/env bash
# Seventeenth session, call L1 (e834b32): (1) the skinny FP8 GEMM's tiles at 17, 32 and 48 rows
# (seed-8b-short-fp8's decode steps), with a few two-field variants beside the default ones;
# (2) the async loop's kernels with PDL on, by the span each adds, for seed-8b-short-fp8,
# moe-30b-a3b-bs1 and seed-8b-bs1-fp8 (benchmarks/probe_step_gaps.py).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/L1; mkdir -p $R
bash benchmarks/gpu_run.sh env > /dev/null 2>&1; head -3 $OUT/log.txt
t0=$(date +%s)
timeout 240 python3 benchmarks/bench_fp8_skinny.py --rows 17,32,48 --jobs 8 --shapes qkv,o,gate_up,down \
  --variants "split6:split_k=6" "split8:split_k=8" "bk256s3:block_k=256,num_stages=3" \
  "bn128w8:block_n=128,num_warps=8" "bm16split8:block_m=16,split_k=8" --out $R/skinny > $R/fp8-skinny.log 2>&1
echo "skinny rc=$? $(( $(date +%s) - t0 )) s"; grep -A12 "^fastest" $R/fp8-skinny.log; tail -2 $R/fp8-skinny.log
for w in seed-8b-short-fp8 moe-30b-a3b-bs1 seed-8b-bs1-fp8; do
  t0=$(date +%s)
  timeout 130 python3 benchmarks/probe_step_gaps.py --workload $w --skip 40 --steps 20 > $R/gaps-$w.log 2>&1
  echo "== gaps $w rc=$? $(( $(date +%s) - t0 )) s"; grep -A16 "^| kernel" $R/gaps-$w.log; grep -A2 "^| stream" $R/gaps-$w.log
done
tar -czf $OUT/L1.tgz -C $OUT L1
