#!/usr/bin/env bash
# Ninth session, call F1: the few-row streaming GEMV (2-4 rows of weights over 15 MiB).
# (1) its tests on the GPU; (2) bench_gemv's 8B layer chain at 1, 2, 4 and 8 rows against
# cuBLAS, the default and four variants (8 rows: stream_max_rows=8); (3) the verify step at one
# row, k = 1-4, with the kernel off (SLIPSTREAM_GEMV_STREAM_ROWS=1: cuBLAS), on, and up to 8
# rows; (4) end to end at batch 1 on the 8B shape, off and on in turn: n-gram k = 3 at 3 tokens
# a step, EAGLE-3 k = 3 at 3.5, plain; (5) with time left, SiLU·mul inside the kernel (verify).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/F1; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  cat COMMIT; } > $R/env.txt 2>&1; cat $R/env.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py > $R/test_gemv.log 2>&1; tail -4 $R/test_gemv.log
timeout 150 python3 benchmarks/bench_gemv.py --models 8b --rows 1,2,4,8 --variant r8:stream_max_rows=8 \
  --variant s4:rows_stages=4 --variant w8:rows_warps=8 --variant bn16:rows_block_n=16 \
  --out $R/gemv > $R/gemv.log 2>&1; grep -v "^wrote" $R/gemv.log
verify() {  # verify NAME ENV=VALUE
  env $2 timeout 90 python3 benchmarks/bench_verify_step.py --models llama-3.1-8b --ks 1 2 3 4 --rows 1 \
    --iters 20 --out $R/verify-$1 > $R/verify-$1.log 2>&1
  echo "== verify $1"; tail -7 $R/verify-$1.log
}
verify off SLIPSTREAM_GEMV_STREAM_ROWS=1; verify on X=1; verify r8 SLIPSTREAM_GEMV_STREAM_ROWS=8
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
M="--gpu-memory-utilization 0.8"
OFF="SLIPSTREAM_GEMV_STREAM_ROWS=1"
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="$OFF --speculative-config $N3 --spec-synthetic-accept 2;X=1 --speculative-config $N3 --spec-synthetic-accept 2;$OFF $M --speculative-config $E3 --spec-synthetic-accept 2.5;X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5;X=1" bash benchmarks/gpu_run.sh ab-env > /dev/null 2>&1
for f in /tmp/res/ab-env-*.log; do echo "== $f"; grep -E "^\| seed|speculation" "$f"; done
mkdir -p $R/ab; cp /tmp/res/ab-env-*.log $R/ab/ 2>/dev/null
verify silu SLIPSTREAM_GEMV_ROWS_SILU=1
