#!/usr/bin/env bash
# Call M (one machine start, priorities first): (1) seed-8b-short-fp8 (async), twice in turn over
# three arms: the handoff off (this tree, SLIPSTREAM_FP8_HANDOFF=0), the products' handoff alone
# (.baseline-4763: 4763018, the package only, =1), and with o_proj's input quantized in the decode
# kernel too (this tree, =1); (2) the kernel tests of both compiled for the GPU; (3) the MoE small
# path's down prefetch: moe-30b-a3b-bs1 at down_prefetch_cols 0 / 256 / 1024, in turn, twice;
# (4) the FP8 async = sync test under graphs.
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
R=$OUT/M; mkdir -p $R
bash benchmarks/gpu_run.sh env > /dev/null 2>&1; cp /tmp/out/log.txt $R/env.log; cat $R/env.log
bench() {  # bench NAME DIR WORKLOAD [ENV...]
  local name=$1 dir=$2 w=$3; shift 3
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=/tmp/site:. "$@" timeout 120 python3 -m slipstream.cli bench --workload $w --mode async --no-measure) > $R/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 )) s $(grep -E "^\| (seed|moe|small)" $R/$name.log | head -1)"
  tar -czf $OUT/M.tgz -C $OUT M
}
for i in 1 2; do
  bench off-$i . seed-8b-short-fp8 SLIPSTREAM_FP8_HANDOFF=0
  bench handoff-$i .baseline-4763 seed-8b-short-fp8 SLIPSTREAM_FP8_HANDOFF=1
  bench attnq-$i . seed-8b-short-fp8 SLIPSTREAM_FP8_HANDOFF=1
done
timeout 120 python3 -m pytest -q tests/test_attention_quant_out.py tests/test_fp8_skinny_handoff.py -k "not smollm2" > $R/tests-kernels.log 2>&1; echo "== kernel tests rc=$? $(tail -1 $R/tests-kernels.log)"
tar -czf $OUT/M.tgz -C $OUT M
for i in 1 2; do
  for c in 0 256 1024; do bench moe-pf$c-$i . moe-30b-a3b-bs1 SLIPSTREAM_MOE_SMALL_CONFIG=down_prefetch_cols=$c; done
done
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_fp8.py -k async_equals_sync > $R/tests-async.log 2>&1; echo "== async tests rc=$? $(tail -1 $R/tests-async.log)"
tar -czf $OUT/M.tgz -C $OUT M
