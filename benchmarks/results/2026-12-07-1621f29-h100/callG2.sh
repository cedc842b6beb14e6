#!/usr/bin/env bash
# Tenth session, call G2 (1621f29): the FP8 sweeps never run on a GPU: (1) the small-batch
# GEMV's configs (bench_fp8_gemv.py) on the 8B layer's four products at 1, 4 and 16 rows,
# variants at 1 and 4 rows; (2) the skinny GEMM's tiles (bench_fp8_skinny.py) at 32 and 64
# rows; (3) a 64-row decode step's profile with FP8 weights, bf16 beside it (PDL off).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/G2; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  cat COMMIT; } > $R/env.txt 2>&1; cat $R/env.txt
t0=$(date +%s)
timeout 250 python3 benchmarks/bench_fp8_gemv.py --rows 1,4,16 --variant-rows 1,4 --shapes qkv,o,gate_up,down \
  --out $R/gemv > $R/fp8-gemv.log 2>&1; echo "gemv rc=$? $(( $(date +%s) - t0 )) s"
grep -A30 "^fastest\|one row, the layer" $R/fp8-gemv.log | head -70
t0=$(date +%s)
timeout 170 python3 benchmarks/bench_fp8_skinny.py --rows 32,64 --out $R/skinny > $R/fp8-skinny.log 2>&1
echo "skinny rc=$? $(( $(date +%s) - t0 )) s"; grep -A14 "^fastest" $R/fp8-skinny.log
t0=$(date +%s)
SLIPSTREAM_PDL=0 timeout 110 python3 benchmarks/profile_step.py --case llama-3.1-8b:64:1024:fp8 --case llama-3.1-8b:64:1024 \
  --out $R/profile > $R/profile.log 2>&1; echo "profile rc=$? $(( $(date +%s) - t0 )) s"; grep -v "^wrote" $R/profile.log | head -60
