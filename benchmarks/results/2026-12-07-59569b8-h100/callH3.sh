#!/usr/bin/env bash
# Eleventh session, call H3 (a fresh machine, the session's last device seconds): the one-pass
# quantization's and SiLU·mul's tests on the GPU after the reference comparison's fix (values,
# ±0 alike), all of them (H1 stopped at the first failure); small-256 against small-256-fp8
# once more (H1: 1.20x); the FP8 GEMV's tile pattern read alone (the fixed probe), as time allows.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/H3; mkdir -p $R
END=$(( $(date +%s) + ${H3_SECONDS:-150} ))
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_fp8_gemm_mid.py \
  -k "quantization or silu" > $R/test-quant.log 2>&1
echo "quant tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $R/test-quant.log
bench() {  # bench NAME WORKLOAD
  fits 35 $1 || return
  t0=$(date +%s)
  timeout $(( END - t0 < 70 ? END - t0 : 70 )) python3 -m slipstream.cli bench --workload $2 --mode async \
    --no-measure > $R/$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (small)|^\| decode" $R/$1.log | head -3
}
bench small-bf16 small-256
bench small-fp8 small-256-fp8
fits 25 tiles || exit 0
timeout $(( END - $(date +%s) )) python3 benchmarks/probe_read_bandwidth.py --fp8-tiles 2>&1 | grep -E "^\| (qkv|o|gate_up|down) " | head -40
