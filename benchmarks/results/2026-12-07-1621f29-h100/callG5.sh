#!/usr/bin/env bash
# Tenth session, call G5 (55b1230: the GEMV's per-slice powers of two; ../.baseline b506f1d,
# with the range pass; ../.baseline2 dbd25c1, before the session's FP8 changes): (1) GPU tests
# of the FP8 GEMV (extreme rows, 8B shapes) and of the routed GEMMs; (2) seed-8b-bs1-fp8 on
# b506f1d and 55b1230 in turn, twice; (3) seed-8b-short-fp8 on dbd25c1 and 55b1230 in turn,
# twice; (4) F6: the speculative warm-up (draft model k=4 A=4, n-gram k=3 A=2, plain).
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=$OUT/G5; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat COMMIT; } > $R/env.txt 2>&1; cat $R/env.txt
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemv_range.py tests/test_fp8_gemv.py > $R/test-gemv.log 2>&1
echo "gemv tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|FAILED" $R/test-gemv.log | tail -8
t0=$(date +%s)
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm_mid.py tests/test_fp8_kernels.py > $R/test-gemm.log 2>&1
echo "gemm tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|FAILED" $R/test-gemm.log | tail -8
bench() {  # bench NAME DIR WORKLOAD [ARGS]
  t0=$(date +%s)
  (cd $2 && PYTHONPATH=/tmp/site:. timeout 150 python3 -m slipstream.cli bench --workload $3 --mode async --no-measure $4) > $R/$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| (seed|small)|^\| decode|speculation \(|rror" $R/$1.log | head -4
}
for i in 1 2; do
  bench bs1-fp8-b506f1d-$i ../.baseline seed-8b-bs1-fp8
  bench bs1-fp8-55b1230-$i . seed-8b-bs1-fp8
done
for i in 1 2; do
  bench short-fp8-dbd25c1-$i ../.baseline2 seed-8b-short-fp8
  bench short-fp8-55b1230-$i . seed-8b-short-fp8
done
N3='{"method":"ngram","num_speculative_tokens":3}'
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
bench f6-draft-a4 . seed-8b-bs1 "--gpu-memory-utilization 0.8 --speculative-config $D4 --spec-synthetic-accept 4"
bench f6-ngram-a2 . seed-8b-bs1 "--speculative-config $N3 --spec-synthetic-accept 2"
bench f6-plain . seed-8b-bs1
