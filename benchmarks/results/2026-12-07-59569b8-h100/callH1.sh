#!/usr/bin/env bash
# Eleventh session, call H1 (59569b8): (1) the one-row FP8 GEMV, which holds seed-8b-bs1-fp8
# at 1.30x its floor: tiles the tenth session's sweep did not reach (1024-wide K tiles with 4
# or 8 warps; 64 weight rows a program with 512-1024-wide tiles in 2-4 stages; 3 stages at
# 512; a K split of 2; 16-64 weight rows a program with 2-4 KB of each row a tile and 8 warps:
# longer runs of each row), the layer's four products at one row, then the engine with the
# sweep's two fastest variants against the default, in turn, twice; (2) small-256 in bf16 and
# with FP8 weights and the FP8 KV cache (small-256-fp8 since 2026-12-07: the 1.2x); (3) the
# one-pass row quantization and SiLU·mul inside it, bit for bit against the reference on the
# GPU (not marked gpu: on a GPU they run on CUDA).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/H1; mkdir -p $R
END=$(( $(date +%s) + ${H1_SECONDS:-500} ))  # each step runs only if its limit fits before END
fits() { [ $(( END - $(date +%s) )) -ge $1 ] || { echo "skipped: $2 (no time left)"; return 1; }; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } 2>&1 | tee $R/env.txt
declare -A V=(
  [w8k1024]="mma_warps=8,mma_block_k=1024,mma_stages=2"
  [k1024]="mma_block_k=1024,mma_stages=2"
  [n64k1024]="mma_block_n=64,mma_block_k=1024,mma_stages=2"
  [n64k1024s3]="mma_block_n=64,mma_block_k=1024,mma_stages=3"
  [k512s3]="mma_block_k=512,mma_stages=3"
  [n64k512s3]="mma_block_n=64,mma_block_k=512,mma_stages=3"
  [n64k512s4]="mma_block_n=64,mma_block_k=512,mma_stages=4"
  [w8k512]="mma_warps=8,mma_block_k=512,mma_stages=2"
  [k512split2]="mma_block_k=512,mma_stages=2,mma_split_k=2"
  [n16k4096w8]="mma_block_n=16,mma_block_k=4096,mma_warps=8,mma_stages=2"
  [n32k2048w8]="mma_block_n=32,mma_block_k=2048,mma_warps=8,mma_stages=2"
  [n64k2048w8]="mma_block_n=64,mma_block_k=2048,mma_warps=8,mma_stages=2"
)
args=(); for n in "${!V[@]}"; do args+=("$n:${V[$n]}"); done
t0=$(date +%s)
timeout 140 python3 benchmarks/bench_fp8_gemv.py --rows 1 --variant-rows 1 --shapes qkv,o,gate_up,down \
  --no-default-variants --variants "${args[@]}" --jobs 4 --out $R/gemv > $R/fp8-gemv.log 2>&1
echo "gemv rc=$? $(( $(date +%s) - t0 )) s"; grep -A16 "one row, the layer" $R/fp8-gemv.log
best=$(sed -n '/one row, the layer/,$p' $R/fp8-gemv.log | grep -E "^\| [a-z0-9-]+ \| [0-9]" \
  | awk -F'|' '$2 !~ / (fp8|bf16) / {print $7, $2}' | sort -n | head -2 | awk '{print $2}')
echo "best: $best"
bench() {  # bench NAME WORKLOAD GEMV_CONFIG [FLAGS]
  fits 60 $1 || return
  t0=$(date +%s)
  SLIPSTREAM_FP8_GEMV_CONFIG="$3" timeout $(( END - t0 < 80 ? END - t0 : 80 )) python3 -m slipstream.cli bench --workload $2 --mode async \
    --no-measure $4 > $R/$1.log 2>&1
  echo "== $1 [$3] rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (seed|small)|^\| decode" $R/$1.log | head -3
}
first=$(echo $best | awk '{print $1}')
bench bs1-default-1 seed-8b-bs1-fp8 ""
for b in $best; do bench bs1-$b-1 seed-8b-bs1-fp8 "${V[$b]}"; done
bench bs1-default-2 seed-8b-bs1-fp8 ""
[ -n "$first" ] && bench bs1-$first-2 seed-8b-bs1-fp8 "${V[$first]}"
bench small-bf16 small-256 ""
bench small-fp8wkv small-256-fp8 ""
fits 60 "quant tests" || exit 0
t0=$(date +%s)
timeout $(( END - t0 )) python3 -m pytest -q -p no:cacheprovider -x tests/test_fp8_kernels.py tests/test_fp8_gemm_mid.py \
  -k "quantization or silu" > $R/test-quant.log 2>&1
echo "quant tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $R/test-quant.log
