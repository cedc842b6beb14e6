#!/usr/bin/env bash
# Ninth session, call F1: the few-row streaming GEMV (2-4 rows of weights over 15 MiB).
# (1) its tests on the GPU; (2) bench_gemv's 8B layer chain at 1, 2 and 4 rows against cuBLAS,
# the default and six variants (8 rows: stream_max_rows=8); the fused forms; (3) the verify step at one row, k = 1-4,
# with the kernel off (SLIPSTREAM_GEMV_STREAM_ROWS=1: cuBLAS), on, on with SiLU·mul inside, and up to 8 rows.
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/F1; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  cat COMMIT; } > $R/env.txt 2>&1; cat $R/env.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py > $R/test_gemv.log 2>&1; tail -4 $R/test_gemv.log
timeout 200 python3 benchmarks/bench_gemv.py --models 8b --rows 1,2,4,8 --variant r8:stream_max_rows=8 --variant s4:rows_stages=4 \
  --variant s2:rows_stages=2 --variant w8:rows_warps=8 --variant bn16:rows_block_n=16 \
  --variant bn4:rows_block_n=4,stream_max_rows=8 --out $R/gemv > $R/gemv.log 2>&1; cat $R/gemv.log | grep -v "^wrote"
for arm in off:SLIPSTREAM_GEMV_STREAM_ROWS=1 on:X=1 silu:SLIPSTREAM_GEMV_ROWS_SILU=1 r8:SLIPSTREAM_GEMV_STREAM_ROWS=8; do
  env ${arm#*:} timeout 100 python3 benchmarks/bench_verify_step.py --models llama-3.1-8b --ks 1 2 3 4 --rows 1 \
    --iters 20 --out $R/verify-${arm%%:*} > $R/verify-${arm%%:*}.log 2>&1
  echo "== verify ${arm%%:*}"; tail -8 $R/verify-${arm%%:*}.log
done
timeout 60 python3 benchmarks/bench_gemv.py --models 8b --rows 2,4 --fused --out $R/gemv-fused > $R/gemv-fused.log 2>&1; grep "| 8b" $R/gemv-fused.log
