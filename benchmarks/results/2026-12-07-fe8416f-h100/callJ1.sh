#!/usr/bin/env bash
# Twelfth session, call J1 (a fresh machine; 024cc9f's tree, the wgmma kernel since removed): the one-row FP8 GEMV on FP8 wgmma
# (ops/triton_fp8_gemv_wgmma.py: the weight tile into e4m3 x e4m3 wgmma untouched, the input
# in three e4m3 parts) against the f16 MMA kernel: its GPU tests, its tilings at one row in
# bench_fp8_gemv.py (the 8B layer's four products), the two fastest in the engine
# (seed-8b-bs1-fp8, in turn with the default); then the one-pass quantization's GPU tests.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/J1; mkdir -p $R
END=$(( $(date +%s) + ${J1_SECONDS:-550} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemv.py -k "wgmma and not pad2" > $R/test-wgmma.log 2>&1
echo "wgmma tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|Error" $R/test-wgmma.log | head -8
declare -A V=(
  [w256s3p4]="wgmma=1"
  [w256s3]="wgmma=1,wgmma_min_m_pad=2"
  [w256s4]="wgmma=1,wgmma_min_m_pad=2,wgmma_stages=4"
  [w128s6]="wgmma=1,wgmma_min_m_pad=2,wgmma_block_k=128,wgmma_stages=6"
)
args=(); for n in "${!V[@]}"; do args+=("$n:${V[$n]}"); done
t0=$(date +%s)
timeout 100 python3 benchmarks/bench_fp8_gemv.py --rows 1 --variant-rows 1 --shapes qkv,o,gate_up,down \
  --no-default-variants --variants "${args[@]}" --jobs 8 --out $R/gemv > $R/fp8-gemv.log 2>&1
echo "gemv rc=$? $(( $(date +%s) - t0 )) s"; grep -E "FAIL|rror" $R/fp8-gemv.log | head -5
grep -A14 "one row, the layer" $R/fp8-gemv.log
best=$(sed -n '/one row, the layer/,$p' $R/fp8-gemv.log | grep -E "^\| [a-z0-9-]+ \| [0-9]" \
  | awk -F'|' '$2 !~ / (fp8|bf16) / {print $7, $2}' | sort -n | head -2 | awk '{print $2}')
echo "best: $best"
bench() {  # bench NAME WORKLOAD GEMV_CONFIG
  fits 50 $1 || return
  t0=$(date +%s)
  SLIPSTREAM_FP8_GEMV_CONFIG="$3" timeout $(( END - t0 < 80 ? END - t0 : 80 )) python3 -m slipstream.cli bench \
    --workload $2 --mode async --no-measure > $R/$1.log 2>&1
  echo "== $1 [$3] rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (seed|small)|^\| decode" $R/$1.log | head -3
}
first=$(echo $best | awk '{print $1}')
bench bs1-default-1 seed-8b-bs1-fp8 ""
for b in $best; do bench bs1-$b-1 seed-8b-bs1-fp8 "${V[$b]}"; done
bench bs1-default-2 seed-8b-bs1-fp8 ""
[ -n "$first" ] && bench bs1-$first-2 seed-8b-bs1-fp8 "${V[$first]}"
fits 40 "quant tests" || exit 0
t0=$(date +%s)
timeout $(( END - t0 )) python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_fp8_gemm_mid.py \
  -k "quantization or silu" > $R/test-quant.log 2>&1
echo "quant tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $R/test-quant.log
