#!/usr/bin/env bash
# Call L2: (1) the skinny GEMM's stage rule (`_stages_for`: 4 stages where 5 leave a second
# wave, i.e. gate_up at 17-32 rows) against its base e834b32 (.baseline-e834, the package only),
# seed-8b-short-fp8, async, twice in turn; (2) seed-8b-bs1-fp8 under decode-attention configs
# (SLIPSTREAM_DECODE_CONFIG), one run each: the one-row step's attention adds ~11 us a layer.
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
R=$OUT/L2; mkdir -p $R
bash benchmarks/gpu_run.sh env > /dev/null 2>&1
bench() {  # bench NAME DIR WORKLOAD [ENV...]
  local name=$1 dir=$2 w=$3; shift 3
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=/tmp/site:. "$@" timeout 150 python3 -m slipstream.cli bench --workload $w --mode async --no-measure) > $R/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 )) s $(grep -E "^\| (seed|moe|small)" $R/$name.log | head -1)"
}
for i in 1 2; do
  bench short-fp8-base-$i .baseline-e834 seed-8b-short-fp8 X=1
  bench short-fp8-new-$i . seed-8b-short-fp8 X=1
done
for arm in "" small_min_chunk=64 small_min_chunk=256 small_min_chunk=512 num_warps=2 num_warps=8 block_n=32 block_n=128 num_stages=3 ctas_per_sm=8 ""; do
  bench "bs1-fp8-${arm:-default}" . seed-8b-bs1-fp8 SLIPSTREAM_DECODE_CONFIG=$arm
done
tar -czf $OUT/L2.tgz -C $OUT L2
