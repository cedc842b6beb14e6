#!/usr/bin/env bash
# Call N1: (1) the small MoE down kernel's loads before its PDL wait (3447935) against its base
# dea64fa (.baseline-dea64fa, the package only) and against early_loads=0 (the peeled first step
# alone), moe-30b-a3b-bs1, async, twice in turn; (2) gate_up tiles and 8 warps through
# SLIPSTREAM_MOE_SMALL_CONFIG, one run each; (3) decode attention at 8 warps, at one KV tile a split
# (64 or 128 tokens) on the one-row workloads, the default first and last; (4) the small MoE path's GPU tests.
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
R=$OUT/N1; mkdir -p $R
bash benchmarks/gpu_run.sh env > /dev/null 2>&1
cp $OUT/log.txt $R/env.txt 2>/dev/null
bench() {  # bench NAME DIR WORKLOAD [ENV...]
  local name=$1 dir=$2 w=$3; shift 3
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=/tmp/site:. "$@" timeout 150 python3 -m slipstream.cli bench --workload $w --mode async --no-measure) > $R/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 )) s $(grep -E "^\| (seed|moe|small)" $R/$name.log | head -1)"
  tar -czf $OUT/N1.tgz -C $OUT N1  # after each run: a call cut short keeps its results
}
for i in 1 2; do
  bench moe-base-$i .baseline-dea64fa moe-30b-a3b-bs1 X=1
  bench moe-early-$i . moe-30b-a3b-bs1 X=1
  bench moe-late-$i . moe-30b-a3b-bs1 SLIPSTREAM_MOE_SMALL_CONFIG=early_loads=0
done
for arm in up_block_n=32 up_block_k=256 up_block_n=8 num_warps=8; do
  bench "moe-$arm" . moe-30b-a3b-bs1 SLIPSTREAM_MOE_SMALL_CONFIG=$arm
done
for arm in "" num_warps=8 small_min_chunk=64 num_warps=8,small_min_chunk=64 num_warps=8,block_n=128 ""; do
  bench "moe-attn-${arm:-default}" . moe-30b-a3b-bs1 SLIPSTREAM_DECODE_CONFIG=$arm
done
for arm in "" num_warps=8 num_warps=8,small_min_chunk=64 num_warps=8,block_n=128 ""; do
  bench "bs1-fp8-attn-${arm:-default}" . seed-8b-bs1-fp8 SLIPSTREAM_DECODE_CONFIG=$arm
done
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_small.py > $R/gputests.log 2>&1; echo "== gputests rc=$? $(tail -1 $R/gputests.log)"
timeout 150 python3 benchmarks/probe_step_gaps.py --workload moe-30b-a3b-bs1 --skip 40 --steps 20 > $R/step-gaps-moe.log 2>&1; echo "== step-gaps rc=$?"; grep -iE "moe|attention|route|norm|gemv" $R/step-gaps-moe.log | head -12
tar -czf $OUT/N1.tgz -C $OUT N1
