#!/usr/bin/env bash
# Thirteenth session, call K3 (.baseline is 03d9d66): row_rstd in float64 (its GPU tests; the
# one-row steps, bf16 and FP8, base and new in turn); the 2-16-row FP8 products: the GEMV
# against the skinny GEMM with the input's quantization (bench_fp8_skinny.py at 2-16 rows, the
# 8B shapes); seed-8b-bs8-fp8 (8 rows a step) with the GEMV up to 16 rows (the default) and up
# to 1 row (2-16 rows on the skinny GEMM), and seed-8b-bs8 in bf16.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/K3; mkdir -p $R
END=$(( $(date +%s) + ${K3_SECONDS:-540} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; cat .baseline/COMMIT; } 2>&1
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -k "silu or qkv_epilogue or rstd or fused" \
  > $R/test-rstd.log 2>&1
echo "rstd tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-rstd.log | tail -6
fits 120 skinny-bench && { t0=$(date +%s)
  timeout 120 python3 benchmarks/bench_fp8_skinny.py --rows 2,4,8,16 --shapes qkv,o,gate_up,down \
    --no-default-variants --jobs 12 --out $R/skinny > $R/fp8-skinny.log 2>&1
  echo "skinny bench rc=$? $(( $(date +%s) - t0 )) s"; grep -E "FAIL|rror" $R/fp8-skinny.log | head -5
  grep -E "^\| (qkv|o|gate_up|down) " $R/fp8-skinny.log | head -80; }
bench() {  # bench NAME DIR WORKLOAD GEMV_CONFIG
  fits 40 $1 || return
  t0=$(date +%s)
  (cd $2 && SLIPSTREAM_FP8_GEMV_CONFIG="$4" PYTHONPATH=/tmp/site:. timeout $(( END - t0 < 90 ? END - t0 : 90 )) \
    python3 -m slipstream.cli bench --workload $3 --mode async --no-measure) > $R/$1.log 2>&1
  echo "== $1 [$4] rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (seed|small)" $R/$1.log | head -2
}
for i in 1 2; do
  bench bs8-fp8-gemv16-$i . seed-8b-bs8-fp8 ""
  bench bs8-fp8-gemv1-$i . seed-8b-bs8-fp8 "max_rows=1"
done
bench bs8-bf16 . seed-8b-bs8 ""
for i in 1 2; do
  bench bs1-fp8-base-$i .baseline seed-8b-bs1-fp8 ""
  bench bs1-fp8-new-$i . seed-8b-bs1-fp8 ""
done
bench bs1-bf16-base .baseline seed-8b-bs1 ""
bench bs1-bf16-new . seed-8b-bs1 ""
