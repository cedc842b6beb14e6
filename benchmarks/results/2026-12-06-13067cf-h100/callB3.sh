#!/usr/bin/env bash
# Fifth session, call B3 (B2 cut down to the device time left after two refused starts): the
# device-drafting kernels' test; batch-1 n-gram on the 0.6B shape against plain (the
# speculative step's host cost); batch-1 FP8 with the one-row stream candidate against the
# MMA default; small-256 plain, FP8, and half constrained in-process.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
N4='{"method":"ngram","num_speculative_tokens":4}'
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
TEST_TIMEOUT=40 TESTS="tests/test_spec_device_drafts_kernel.py" $B pytests-each
REPS=1 WORKLOADS="small-bs1" ARMS="X=1;X=1 --speculative-config $N4 --spec-synthetic-accept 3" $B ab-env
REPS=1 WORKLOADS="seed-8b-bs1-fp8" ARMS="X=1;SLIPSTREAM_FP8_GEMV=stream" $B ab-env
REPS=1 WORKLOADS="small-256" ARMS="X=1;X=1 --quantization fp8" $B ab-env
REPS=1 WORKLOADS="small-256-json-half" ARMS="X=1 $G --structured-outputs-workers 0" $B ab-env
