#!/usr/bin/env bash
# Call L3 (ca00b27): (1) seed-8b-short in bf16 and seed-8b-short-fp8, twice in turn (the ratio
# with the skinny stage rule); (2) the shared log-sum-exp merge (ca00b27) against its base
# 51873ed (.baseline-51873, the package only): seed-8b-bs8 and small-256, twice in turn.
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
R=$OUT/L3; mkdir -p $R
bash benchmarks/gpu_run.sh env > /dev/null 2>&1
bench() {  # bench NAME DIR WORKLOAD
  t0=$(date +%s)
  (cd $2 && env PYTHONPATH=/tmp/site:. timeout 150 python3 -m slipstream.cli bench --workload $3 --mode async --no-measure) > $R/$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s $(grep -E "^\| (seed|moe|small)" $R/$1.log | head -1)"
}
for i in 1 2; do
  bench short-bf16-$i . seed-8b-short
  bench short-fp8-$i . seed-8b-short-fp8
done
for i in 1 2; do
  for w in seed-8b-bs8 small-256; do
    bench $w-base-$i .baseline-51873 $w
    bench $w-lse-$i . $w
  done
done
tar -czf $OUT/L3.tgz -C $OUT L3
