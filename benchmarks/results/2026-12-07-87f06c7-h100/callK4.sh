#!/usr/bin/env bash
# Thirteenth session, call K4: the FP8 GEMV at one row only (max_rows=1, 2-16 rows on the
# skinny GEMM): the skinny GEMM's GPU tests at 1-256 rows, row_rstd's GPU tests (K3's run
# stopped at collection); seed-8b-bs1-fp8 with the GEMV (the default) and without it
# (max_rows=0: one row on the skinny GEMM too), in turn, twice; seed-8b-bs8-fp8 at the new
# default and seed-8b-bs8 in bf16.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/K4; mkdir -p $R
END=$(( $(date +%s) + ${K4_SECONDS:-400} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm_mid.py \
  -k "skinny_at_8b or silu_mul_in_the_quantization" > $R/test-skinny.log 2>&1
echo "skinny tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-skinny.log | tail -6
t0=$(date +%s)
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py tests/test_gemv.py \
  tests/test_moe_kernels.py tests/test_moe_small.py -k "silu or qkv_epilogue or rstd or fused" > $R/test-rstd.log 2>&1
echo "rstd tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-rstd.log | tail -6
bench() {  # bench NAME WORKLOAD GEMV_CONFIG
  fits 35 $1 || return
  t0=$(date +%s)
  SLIPSTREAM_FP8_GEMV_CONFIG="$3" timeout $(( END - t0 < 90 ? END - t0 : 90 )) \
    python3 -m slipstream.cli bench --workload $2 --mode async --no-measure > $R/$1.log 2>&1
  echo "== $1 [$3] rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (seed|small)" $R/$1.log | head -2
}
for i in 1 2; do
  bench bs1-fp8-gemv-$i seed-8b-bs1-fp8 ""
  bench bs1-fp8-skinny-$i seed-8b-bs1-fp8 "max_rows=0"
done
bench bs8-fp8 seed-8b-bs8-fp8 ""
bench bs8-bf16 seed-8b-bs8 ""
