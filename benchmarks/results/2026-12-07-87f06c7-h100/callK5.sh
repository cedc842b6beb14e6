#!/usr/bin/env bash
# Thirteenth session, call K5 (78adab5; .baseline is 53a9663, the tree before it): the skinny
# FP8 GEMM's split-K counters left at zero by each launch instead of a memset kernel before
# it: the GPU tests of the routed kernels in graphs and of the one-row GEMV's split-K; then
# seed-8b-short-fp8 (32 rows a step: the skinny GEMM) and seed-8b-bs8-fp8, base and new in
# turn, twice each.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/K5; mkdir -p $R
END=$(( $(date +%s) + ${K5_SECONDS:-300} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .baseline/COMMIT; } 2>&1
t0=$(date +%s)
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm_mid.py tests/test_fp8_gemv.py \
  -k "graph or skinny_at_8b" > $R/test.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test.log | tail -6
bench() {  # bench NAME DIR WORKLOAD
  fits 30 $1 || return
  t0=$(date +%s)
  (cd $2 && PYTHONPATH=/tmp/site:. timeout $(( END - t0 < 80 ? END - t0 : 80 )) \
    python3 -m slipstream.cli bench --workload $3 --mode async --no-measure) > $R/$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (seed|small)" $R/$1.log | head -2
}
for i in 1 2; do
  bench short-fp8-base-$i .baseline seed-8b-short-fp8
  bench short-fp8-new-$i . seed-8b-short-fp8
done
for i in 1 2; do
  bench bs8-fp8-base-$i .baseline seed-8b-bs8-fp8
  bench bs8-fp8-new-$i . seed-8b-bs8-fp8
done
