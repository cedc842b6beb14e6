#!/usr/bin/env bash
# Call N2: the split policy's chunk at small batches (the runner's graphs for up to
# small_batch rows take small_min_chunk tokens a split, as the kernel does) against its base
# 3447935 (.baseline-3447935, the package only), in turn; then the policy with one tile a split
# and the MoE down kernel's own stage count, one run each; the decode kernels' GPU tests.
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
R=$OUT/N2; mkdir -p $R
bash benchmarks/gpu_run.sh env > /dev/null 2>&1
bench() {  # bench NAME DIR WORKLOAD [ENV...]
  local name=$1 dir=$2 w=$3; shift 3
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=/tmp/site:. "$@" timeout 120 python3 -m slipstream.cli bench --workload $w --mode async --no-measure) > $R/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 )) s $(grep -E "^\| (seed|moe|small)" $R/$name.log | head -1)"
  tar -czf $OUT/N2.tgz -C $OUT N2
}
for i in 1 2; do
  for w in seed-8b-bs1-fp8 moe-30b-a3b-bs1; do
    bench $w-base-$i .baseline-3447935 $w X=1
    bench $w-new-$i . $w X=1
  done
done
for w in small-bs1 seed-8b-bs8-fp8; do
  bench $w-base .baseline-3447935 $w X=1
  bench $w-new . $w X=1
done
bench seed-8b-bs1-fp8-mc64 . seed-8b-bs1-fp8 SLIPSTREAM_DECODE_CONFIG=small_min_chunk=64
bench moe-30b-a3b-bs1-mc64 . moe-30b-a3b-bs1 SLIPSTREAM_DECODE_CONFIG=small_min_chunk=64
bench seed-8b-bs1-fp8-w8bn128 . seed-8b-bs1-fp8 SLIPSTREAM_DECODE_CONFIG=num_warps=8,block_n=128
bench moe-30b-a3b-bs1-ds6 . moe-30b-a3b-bs1 SLIPSTREAM_MOE_SMALL_CONFIG=down_stages=6
bench moe-30b-a3b-bs1-ds8 . moe-30b-a3b-bs1 SLIPSTREAM_MOE_SMALL_CONFIG=down_stages=8
timeout 150 python3 -m pytest -q -x -m gpu tests/test_attention_kernels.py tests/test_moe_small.py -k "decode or graph or split or small" > $R/gputests.log 2>&1; echo "== gputests rc=$? $(tail -1 $R/gputests.log)"
tar -czf $OUT/N2.tgz -C $OUT N2
