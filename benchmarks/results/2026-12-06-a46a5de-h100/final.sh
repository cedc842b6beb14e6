#!/usr/bin/env bash
# This session's last device call, run from the archived tree (.head) with ../.whl, ../.smoltok
# and ../.baseline (f5d41d0) beside it: the measurements first, in order of need, then tests.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
N3='{"method":"ngram","num_speculative_tokens":3}'
E4='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":4}'
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
$B env
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
# structured outputs (43): all and half the rows constrained, grammar workers by default; in-process beside
BENCH_TIMEOUT=100 BENCH_ARGS="$G" WORKLOADS="small-256-json small-256-json-half" $B benches
REPS=1 WORKLOADS="small-256-json" ARMS="X=1 $G --structured-outputs-workers 0" $B ab-env
(timeout 90 python3 benchmarks/probe_grammar_random.py --tokenizer ../.smoltok --workers 0 2 4 8 2>&1 | tail -12 > /tmp/res/probe-grammar.log)
# the hot path against the session's start (f5d41d0)
TREES="../.baseline ." WORKLOADS="small-256" REPS=1 $B ab-trees
# speculation (45): the verification step's cost, then batch 1 with synthetic acceptance
(timeout 130 python3 benchmarks/bench_verify_step.py --ks 1 2 3 4 7 --iters 20 --out /tmp/res > /tmp/res/verify-step.log 2>&1)
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1;X=1 --speculative-config $N3 --spec-synthetic-accept 2;X=1 --gpu-memory-utilization 0.8 --speculative-config $E4 --spec-synthetic-accept 2;X=1 --gpu-memory-utilization 0.8 --speculative-config $E4 --spec-synthetic-accept 3;X=1 --gpu-memory-utilization 0.8 --speculative-config $D4 --spec-synthetic-accept 3" $B ab-env
REPS=1 WORKLOADS="small-256" ARMS="X=1 --speculative-config {\"method\":\"ngram\",\"num_speculative_tokens\":3,\"disable_by_batch_size\":8}" $B ab-env
# MoE (47): one row, the small path off then on
REPS=1 WORKLOADS="moe-30b-a3b-bs1" ARMS="SLIPSTREAM_MOE_SMALL_TOKENS=0;X=1" $B ab-env
# FP8 (46): the old kernels (FMA GEMV, _scaled_mm) then the new defaults
REPS=1 WORKLOADS="seed-8b-bs1-fp8 seed-8b-short-fp8" ARMS="SLIPSTREAM_FP8_GEMV_FMA_ROWS=1 SLIPSTREAM_FP8_ROUTES=channel=scaled_mm/block=triton;X=1" $B ab-env
# GPU tests of this session's code
TEST_TIMEOUT=75 TESTS="tests/test_gpu_structured_outputs.py tests/test_gpu_spec_verify.py tests/test_fp8_gemv.py tests/test_moe_small.py tests/test_fp8_gemm_mid.py tests/test_gpu_spec_drafters.py" $B pytests-each
tar -czf "$OUT/results.tgz" -C /tmp/res .
cd /tmp/res || exit 0
for f in pytest-*.log; do echo "$f: $(tail -1 "$f")"; grep -E "^(FAILED|ERROR)" "$f" | head -5; done
grep -h -E "^\| (small|seed|moe)" bench-*.log ab-*.log 2>/dev/null | cut -c1-150
grep -h -E "speculation|grammar CPU" ab-env-*.log bench-*.log 2>/dev/null | cut -c1-160
tail -25 verify-step.log 2>/dev/null
cat probe-grammar.log
