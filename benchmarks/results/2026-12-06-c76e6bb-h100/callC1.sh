#!/usr/bin/env bash
# Sixth session, call C1: the fifth session's B3 (never run: device-drafting kernels' test,
# batch-1 n-gram on the 0.6B shape against plain, batch-1 FP8 one-row stream candidate against
# the MMA default, small-256 plain against FP8, half constrained in-process), then the FP8 GPU
# tests fixed since their last GPU run.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
N4='{"method":"ngram","num_speculative_tokens":4}'
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
TEST_TIMEOUT=60 TESTS="tests/test_spec_device_drafts_kernel.py" $B pytests-each
REPS=1 WORKLOADS="small-bs1" ARMS="X=1;X=1 --speculative-config $N4 --spec-synthetic-accept 3" $B ab-env
REPS=1 WORKLOADS="seed-8b-bs1-fp8" ARMS="X=1;SLIPSTREAM_FP8_GEMV=stream" $B ab-env
REPS=1 WORKLOADS="small-256" ARMS="X=1;X=1 --quantization fp8" $B ab-env
REPS=1 WORKLOADS="small-256-json-half" ARMS="X=1 $G --structured-outputs-workers 0" $B ab-env
TEST_TIMEOUT=90 TESTS="tests/test_fp8_gemv_range.py tests/test_fp8_gemm_mid.py tests/test_fp8_gemv_stream.py tests/test_gpu_fp8.py tests/test_spec_ngram_graph_keys.py tests/test_profile_bench.py" $B pytests-each
