#!/usr/bin/env bash
# Thirteenth session, call K1: Nsight Compute on the one-row FP8 GEMV against the bf16 GEMV and
# the FP8 tile read on the same weights (benchmarks/ncu_one_row.py); why the fused SiLU·mul
# down product differs in bits at 300 rows (probe_silu_quant.py); seed-8b-short-fp8's kernel
# time by kernel (PDL off); the routed FP8 GEMMs' GPU tests.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
HERE=benchmarks/results/2026-12-07-87f06c7-h100
R=$OUT/K1; mkdir -p $R
END=$(( $(date +%s) + ${K1_SECONDS:-480} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
ncu --version | tail -1
t0=$(date +%s)
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,\
launch__registers_per_thread,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,launch__grid_size,\
smsp__inst_executed.sum,smsp__cycles_active.avg,sm__cycles_elapsed.max,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,\
regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
timeout 170 ncu --clock-control none --profile-from-start off -k regex:"gemv|tile_read" --metrics $METRICS \
  --csv --page raw python3 benchmarks/ncu_one_row.py > $R/ncu-raw.csv 2> $R/ncu.err
echo "ncu rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $R/ncu.err
python3 $HERE/ncu_table.py $R/ncu-raw.csv
fits 150 sections && { t0=$(date +%s)
  timeout 140 ncu --clock-control none --profile-from-start off -k regex:"gemv|tile_read" --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy python3 benchmarks/ncu_one_row.py \
    > $R/ncu-sections.txt 2>&1
  echo "ncu sections rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "^\s+[a-z_]*(gemv|tile_read)|Duration|DRAM Throughput|L2 Hit|Achieved Occupancy|Warp Cycles Per Issued|Mem Busy|Max Bandwidth|Mem Pipes|OPT|Theoretical Occ" $R/ncu-sections.txt | cut -c1-150 | head -80; }
fits 100 probe && { t0=$(date +%s)
  timeout 90 python3 $HERE/probe_silu_quant.py 2>&1 | tail -8
  echo "probe rc=$? $(( $(date +%s) - t0 )) s"; }
fits 100 profile && { t0=$(date +%s)
  SLIPSTREAM_PDL=0 timeout 130 python3 benchmarks/profile_bench.py --workload seed-8b-short-fp8 --mode async \
    --steps 20 --top 22 > $R/profile-short-fp8.log 2>&1
  echo "profile rc=$? $(( $(date +%s) - t0 )) s"
  grep -v -E "^(engine start|async: garbage)" $R/profile-short-fp8.log | tail -45; }
fits 60 gemm_mid && { t0=$(date +%s)
  timeout $(( END - t0 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm_mid.py > $R/test-gemm-mid.log 2>&1
  echo "gemm_mid rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-gemm-mid.log | tail -6; }
