#!/usr/bin/env bash
# Sixth session, call C1 (cut to the device time left after six refused starts; ordered by
# what decides most): the device-drafting kernels' test; small-256 plain and half constrained
# in-process; the FP8 GPU tests fixed since their last run; batch-1 n-gram on the 0.6B shape
# against plain (the speculative step's host cost); small-256 with FP8 weights.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
N4='{"method":"ngram","num_speculative_tokens":4}'
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
TEST_TIMEOUT=60 TESTS="tests/test_spec_device_drafts_kernel.py" $B pytests-each
REPS=1 WORKLOADS="small-256" ARMS="X=1" $B ab-env
REPS=1 WORKLOADS="small-256-json-half" ARMS="X=1 $G --structured-outputs-workers 0" $B ab-env
TEST_TIMEOUT=80 TESTS="tests/test_fp8_gemv_range.py tests/test_fp8_gemm_mid.py tests/test_gpu_fp8.py" $B pytests-each
REPS=1 WORKLOADS="small-bs1" ARMS="X=1;X=1 --speculative-config $N4 --spec-synthetic-accept 3" $B ab-env
REPS=1 WORKLOADS="small-256" ARMS="X=1 --quantization fp8" $B ab-env
TEST_TIMEOUT=60 TESTS="tests/test_fp8_gemv_stream.py tests/test_spec_ngram_graph_keys.py" $B pytests-each
