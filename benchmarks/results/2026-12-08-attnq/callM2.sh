#!/usr/bin/env bash
# Call M2: (1) the MoE small path's down prefetch before its PDL wait: moe-30b-a3b-bs1 at
# down_prefetch_cols 0 / 256 / 1024, in turn, twice; (2) seed-8b-bs8-fp8 (8 rows: the skinny route)
# with the handoff off, alone (.baseline-4763) and with attention's quantized output, in turn, twice.
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
R=$OUT/M2; mkdir -p $R
bench() {  # bench NAME DIR WORKLOAD [ENV...]
  local name=$1 dir=$2 w=$3; shift 3
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=/tmp/site:. "$@" timeout 150 python3 -m slipstream.cli bench --workload $w --mode async --no-measure) > $R/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 )) s $(grep -E "^\| (seed|moe|small)" $R/$name.log | head -1)"
}
for i in 1 2; do
  for c in 0 256 1024; do bench moe-pf$c-$i . moe-30b-a3b-bs1 SLIPSTREAM_MOE_SMALL_CONFIG=down_prefetch_cols=$c; done
done
for i in 1 2; do
  bench bs8-off-$i . seed-8b-bs8-fp8 SLIPSTREAM_FP8_HANDOFF=0
  bench bs8-handoff-$i .baseline-4763 seed-8b-bs8-fp8 SLIPSTREAM_FP8_HANDOFF=1
  bench bs8-attnq-$i . seed-8b-bs8-fp8 SLIPSTREAM_FP8_HANDOFF=1
done
tar -czf $OUT/M2.tgz -C $OUT M2
