#!/usr/bin/env bash
# Eleventh session, call H2 (59569b8), after H1: the FP8 GEMV's tile pattern read with nothing
# but a sum (probe_read_bandwidth.py --fp8-tiles: does the pattern or the kernel's work bound
# the one-row GEMV?); the routed GEMMs' GPU tests (fast
# accumulation's bound, graph replays); small-256 with FP8 weights alone and with the FP8 KV
# cache alone; the one-row FP8 step's kernels with PDL off (their durations).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/H2; mkdir -p $R
t0=$(date +%s)
timeout 120 python3 benchmarks/probe_read_bandwidth.py --fp8-tiles > $R/tiles.log 2>&1
echo "tiles rc=$? $(( $(date +%s) - t0 )) s"; cat $R/tiles.log | head -45
t0=$(date +%s)
timeout 170 python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/test_fp8_gemm_mid.py > $R/test-gemm-mid.log 2>&1
echo "gemm_mid rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $R/test-gemm-mid.log
bench() {  # bench NAME WORKLOAD [FLAGS]
  t0=$(date +%s)
  timeout 90 python3 -m slipstream.cli bench --workload $2 --mode async --no-measure $3 > $R/$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (seed|small)|^\| decode" $R/$1.log | head -3
}
bench small-fp8w small-256 "--quantization fp8"
bench small-fp8kv small-256 "--kv-cache-dtype fp8"
t0=$(date +%s)
SLIPSTREAM_PDL=0 timeout 100 python3 benchmarks/profile_step.py --case llama-3.1-8b:1:1024:fp8 \
  --out $R/profile > $R/profile.log 2>&1; echo "profile rc=$? $(( $(date +%s) - t0 )) s"
grep -v "^wrote" $R/profile.log | head -40
