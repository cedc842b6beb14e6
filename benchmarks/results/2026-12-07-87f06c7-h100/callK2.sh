#!/usr/bin/env bash
# Thirteenth session, call K2 (338cbe4; .baseline is 03d9d66, the tree before it): the FP8
# GEMV in equal runs of tiles (mma_programs_per_sm) and row_rstd in float64: GPU tests; the 8B
# products at 1, 4, 16 rows (bench_fp8_gemv.py); Nsight Compute on gate_up and down at one row;
# seed-8b-bs1-fp8 on the base, the new default and the runs, in turn, twice; seed-8b-bs1 (bf16)
# base and new (row_rstd is in its qkv epilogue).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
HERE=benchmarks/results/2026-12-07-87f06c7-h100
R=$OUT/K2; mkdir -p $R
END=$(( $(date +%s) + ${K2_SECONDS:-540} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; cat .baseline/COMMIT; } 2>&1
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemv.py -k "runs or graph" > $R/test-gemv.log 2>&1
echo "gemv tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-gemv.log | tail -6
t0=$(date +%s)
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm_mid.py tests/test_fp8_kernels.py \
  -k "silu_mul_in_the_quantization or silu" > $R/test-silu.log 2>&1
echo "silu tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-silu.log | tail -6
fits 120 gemv-bench && { t0=$(date +%s)
  timeout 120 python3 benchmarks/bench_fp8_gemv.py --rows 1,4,16 --variant-rows 1,4,16 --shapes qkv,o,gate_up,down \
    --no-default-variants --variants runs2:mma_programs_per_sm=2 runs1:mma_programs_per_sm=1 --jobs 12 \
    --out $R/gemv > $R/fp8-gemv.log 2>&1
  echo "gemv bench rc=$? $(( $(date +%s) - t0 )) s"; grep -E "FAIL|rror" $R/fp8-gemv.log | head -5
  sed -n '/^| shape/,$p' $R/fp8-gemv.log | grep -v "^$" | tail -60; }
fits 60 ncu && { t0=$(date +%s)
  METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,\
launch__occupancy_limit_registers,smsp__cycles_active.avg,smsp__cycles_active.min,smsp__cycles_active.max,\
sm__cycles_elapsed.avg,regex:smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  timeout 60 ncu --clock-control none --profile-from-start off -k regex:"gemv|tile_read" --metrics $METRICS \
    --csv --page raw python3 benchmarks/ncu_one_row.py > $R/ncu-raw.csv 2> $R/ncu.err
  echo "ncu rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $R/ncu.err
  python3 $HERE/ncu_table.py $R/ncu-raw.csv \
    "gate_up fp8,gate_up fp8 runs,gate_up bf16,gate_up read,down fp8,down fp8 runs,down bf16,down read"; }
bench() {  # bench NAME DIR WORKLOAD GEMV_CONFIG
  fits 45 $1 || return
  t0=$(date +%s)
  (cd $2 && SLIPSTREAM_FP8_GEMV_CONFIG="$4" PYTHONPATH=/tmp/site:. timeout $(( END - t0 < 90 ? END - t0 : 90 )) \
    python3 -m slipstream.cli bench --workload $3 --mode async --no-measure) > $R/$1.log 2>&1
  echo "== $1 [$4] rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (seed|small)" $R/$1.log | head -2
}
for i in 1 2; do
  bench bs1-fp8-base-$i .baseline seed-8b-bs1-fp8 ""
  bench bs1-fp8-new-$i . seed-8b-bs1-fp8 ""
  bench bs1-fp8-runs2-$i . seed-8b-bs1-fp8 "mma_programs_per_sm=2"
done
bench bs1-bf16-base .baseline seed-8b-bs1 ""
bench bs1-bf16-new . seed-8b-bs1 ""
