#!/usr/bin/env bash
# Tenth session, call G4: (1) seed-8b-bs1-fp8 on a46a5de (3.55 ms a step in its session) and on
# 1621f29 (3.98 ms in G3), twice each in turn: is the one-row FP8 step slower since?; (2) the
# skinny GEMM's tiles at 64 rows with 4 compile workers (G2's 14 ran out of GPU memory).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/G4; mkdir -p $R
bench() {  # bench NAME DIR WORKLOAD [ENV]
  t0=$(date +%s)
  (cd $2 && env PYTHONPATH=/tmp/site:. $4 timeout 150 python3 -m slipstream.cli bench --workload $3 --mode async --no-measure) > $R/$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| seed|rror" $R/$1.log | head -3
}
for i in 1 2; do
  bench bs1-fp8-a46a5de-$i ../.baseline2 seed-8b-bs1-fp8
  bench bs1-fp8-head-$i . seed-8b-bs1-fp8
done
t0=$(date +%s)
timeout 200 python3 benchmarks/bench_fp8_skinny.py --rows 64 --jobs 4 --out $R/skinny > $R/fp8-skinny.log 2>&1
echo "skinny rc=$? $(( $(date +%s) - t0 )) s"; grep -A8 "^fastest" $R/fp8-skinny.log; tail -2 $R/fp8-skinny.log
