#!/usr/bin/env bash
# Twelfth session, call J2 (after J1, the same machine if still held): the wgmma GEMV's
# tilings at 2, 4, 8 and 16 rows against the f16 MMA kernel; where seed-8b-short-fp8's decode
# step (32 rows, FP8 weights and KV cache) spends its kernel time (PDL off: true kernel
# times); the routed GEMMs' GPU tests (test_fp8_gemm_mid -m gpu).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/J2; mkdir -p $R
END=$(( $(date +%s) + ${J2_SECONDS:-540} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
timeout 150 python3 benchmarks/bench_fp8_gemv.py --rows 2,4,8,16 --variant-rows 2,4,8,16 --shapes qkv,o,gate_up,down \
  --no-default-variants --variants "w256s3:wgmma=1,wgmma_min_m_pad=2" "w128s4:wgmma=1,wgmma_min_m_pad=2,wgmma_block_k=128,wgmma_stages=4" \
  "w256s4:wgmma=1,wgmma_min_m_pad=2,wgmma_stages=4" --jobs 8 --out $R/gemv > $R/fp8-gemv-rows.log 2>&1
echo "gemv rows rc=$? $(( $(date +%s) - t0 )) s"; grep -E "FAIL|rror" $R/fp8-gemv-rows.log | head -5
sed -n '/fastest FP8 GEMV/,$p' $R/fp8-gemv-rows.log | head -24
fits 100 profile && { t0=$(date +%s)
  SLIPSTREAM_PDL=0 timeout 130 python3 benchmarks/profile_bench.py --workload seed-8b-short-fp8 --mode async \
    --steps 20 --top 22 > $R/profile-short-fp8.log 2>&1
  echo "profile rc=$? $(( $(date +%s) - t0 )) s"
  grep -v -E "^(engine start|async: garbage)" $R/profile-short-fp8.log | tail -60; }
fits 60 gemm_mid && { t0=$(date +%s)
  timeout $(( END - t0 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm_mid.py > $R/test-gemm-mid.log 2>&1
  echo "gemm_mid rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-gemm-mid.log | tail -6; }
