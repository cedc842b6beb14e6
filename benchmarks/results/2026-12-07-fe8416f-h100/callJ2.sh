#!/usr/bin/env bash
# Twelfth session, call J2 (written after J1; not run: no device time left): why the fused
# SiLU·mul down product differs in bits at 300 rows (probe_silu_quant.py); where
# seed-8b-short-fp8's decode step (32 rows, FP8 weights and KV cache) spends its kernel time
# (PDL off: true kernel times); the routed GEMMs' GPU tests (test_fp8_gemm_mid -m gpu).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/J2; mkdir -p $R
END=$(( $(date +%s) + ${J2_SECONDS:-540} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
timeout 90 python3 benchmarks/results/2026-12-07-fe8416f-h100/probe_silu_quant.py 2>&1 | tail -8
echo "probe rc=$? $(( $(date +%s) - t0 )) s"
fits 100 profile && { t0=$(date +%s)
  SLIPSTREAM_PDL=0 timeout 130 python3 benchmarks/profile_bench.py --workload seed-8b-short-fp8 --mode async \
    --steps 20 --top 22 > $R/profile-short-fp8.log 2>&1
  echo "profile rc=$? $(( $(date +%s) - t0 )) s"
  grep -v -E "^(engine start|async: garbage)" $R/profile-short-fp8.log | tail -60; }
fits 60 gemm_mid && { t0=$(date +%s)
  timeout $(( END - t0 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm_mid.py > $R/test-gemm-mid.log 2>&1
  echo "gemm_mid rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-gemm-mid.log | tail -6; }
