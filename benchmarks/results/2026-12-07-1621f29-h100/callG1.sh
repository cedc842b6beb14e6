#!/usr/bin/env bash
# Tenth session, call G1 (1621f29; ../.baseline is dbd25c1, the tree before the SiLU·mul
# quantization): (1) the GPU tests of the fused SiLU·mul quantization; (2) seed-8b-bs1-fp8 with
# the FP8 GEMV's default config, then mma_prefetch_k = 1024 and 4096 (SLIPSTREAM_FP8_GEMV_CONFIG);
# (3) seed-8b-short-fp8 on dbd25c1 and on 1621f29, in turn, and seed-8b-short in bf16; (4) the
# prefill GEMMs at 8192 and 16384 rows: bf16, the routed path, _scaled_mm without and with fast
# accumulation, per tensor.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/G1; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  cat COMMIT; cat ../.baseline/COMMIT; } > $R/env.txt 2>&1; cat $R/env.txt
t0=$(date +%s)
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm_mid.py -k "silu" > $R/test-silu.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $R/test-silu.log
rm -rf /tmp/res; mkdir -p /tmp/res
t0=$(date +%s)
V=SLIPSTREAM_FP8_GEMV_CONFIG
REPS=1 WORKLOADS="seed-8b-bs1-fp8" ARMS="X=1;$V=mma_prefetch_k=1024;$V=mma_prefetch_k=4096" bash benchmarks/gpu_run.sh ab-env > /dev/null 2>&1
for f in /tmp/res/ab-env-*.log; do echo "== ${f#/tmp/res/ab-env-}"; grep -E "^\| seed" "$f"; done
mkdir -p $R/ab; cp /tmp/res/ab-env-*.log $R/ab/ 2>/dev/null
echo "bs1 A/B $(( $(date +%s) - t0 )) s"
bench() {  # bench NAME DIR WORKLOAD
  t0=$(date +%s)
  (cd $2 && PYTHONPATH=/tmp/site:. timeout 150 python3 -m slipstream.cli bench --workload $3 --mode async --no-measure) > $R/$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| seed|^\| decode|^\| with" $R/$1.log
}
bench short-fp8-base ../.baseline seed-8b-short-fp8
bench short-fp8-new . seed-8b-short-fp8
bench short-bf16 . seed-8b-short
t0=$(date +%s)
timeout 110 python3 benchmarks/bench_fp8_gemm.py --rows 8192,16384 --variants bf16,fp8,mm,mm-fast,mm-tensor-fast \
  --out $R/gemm > $R/fp8-gemm.log 2>&1; echo "gemm rc=$? $(( $(date +%s) - t0 )) s"
grep -v "^wrote" $R/fp8-gemm.log | tail -45
