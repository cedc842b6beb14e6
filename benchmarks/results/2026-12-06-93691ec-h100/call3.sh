#!/usr/bin/env bash
# The fourth session's third device call, from the archived tree (.head) with ../.whl and
# ../.smoltok: structured outputs with the bitmask fill overlapped with scheduling (in-process)
# against 4 grammar workers beside plain small-256; the verification step with the 2-16-row
# GEMV on and off; batch 1 with synthetic acceptance (the EAGLE-3 and draft-model steps now in
# CUDA graphs); small-256 with speculation disabled above 8 rows; the new GPU tests.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
N3='{"method":"ngram","num_speculative_tokens":3}'
E4='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":4}'
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=/tmp/res
REPS=1 WORKLOADS="small-256" ARMS="X=1" $B ab-env
REPS=1 WORKLOADS="small-256-json" ARMS="X=1 $G --structured-outputs-workers 0;X=1 $G --structured-outputs-workers 4" $B ab-env
REPS=1 WORKLOADS="small-256-json-half" ARMS="X=1 $G --structured-outputs-workers 0" $B ab-env
(timeout 80 python3 benchmarks/bench_verify_step.py --ks 1 2 3 4 --rows 1 8 --iters 20 --out $R/verify-on > $R/verify-on.log 2>&1)
(SLIPSTREAM_GEMV_MMA_ROWS=0 timeout 80 python3 benchmarks/bench_verify_step.py --ks 1 2 3 4 --rows 1 8 --iters 20 --out $R/verify-off > $R/verify-off.log 2>&1)
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1;X=1 --speculative-config $N3 --spec-synthetic-accept 2;X=1 --gpu-memory-utilization 0.8 --speculative-config $E4 --spec-synthetic-accept 3;X=1 --gpu-memory-utilization 0.8 --speculative-config $D4 --spec-synthetic-accept 3" $B ab-env
REPS=1 WORKLOADS="small-256" ARMS="X=1 --speculative-config {\"method\":\"ngram\",\"num_speculative_tokens\":3,\"disable_by_batch_size\":8}" $B ab-env
TEST_TIMEOUT=60 TESTS="tests/test_spec_draft_graphs.py tests/test_gemv_mma.py" $B pytests-each
tar -czf "$OUT/results.tgz" -C /tmp/res .
cd /tmp/res || exit 0
for f in pytest-*.log; do echo "$f: $(tail -1 "$f")"; grep -E "^(FAILED|ERROR)" "$f" | head -5; done
grep -h -E "^\| (small|seed|moe)" ab-*.log 2>/dev/null | cut -c1-150
grep -h -E "speculation|grammar CPU" ab-env-*.log 2>/dev/null | cut -c1-160
tail -14 verify-on.log; tail -14 verify-off.log
