#!/usr/bin/env bash
# Fifth session, call B2 (tree in .head/COMMIT; the first try was refused at start): batch-1
# FP8 with the one-row stream candidate against the MMA default; small-256 plain, FP8, and half
# constrained in-process; batch-1 EAGLE-3 at 3.5 tokens a step (synthetic acceptance 2.5 of
# k = 4 and 3) against plain; batch-1 n-gram on the 0.6B shape (the speculative step's host
# cost) against plain; the device-drafting kernels' and the FP8 GEMM tests.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
E4='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":4}'
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N4='{"method":"ngram","num_speculative_tokens":4}'
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=1 WORKLOADS="seed-8b-bs1-fp8" ARMS="X=1;SLIPSTREAM_FP8_GEMV=stream" $B ab-env
REPS=1 WORKLOADS="small-256" ARMS="X=1;X=1 --quantization fp8" $B ab-env
REPS=1 WORKLOADS="small-256-json-half" ARMS="X=1 $G --structured-outputs-workers 0" $B ab-env
REPS=1 WORKLOADS="small-bs1" ARMS="X=1;X=1 --speculative-config $N4 --spec-synthetic-accept 3" $B ab-env
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1;X=1 --gpu-memory-utilization 0.8 --speculative-config $E4 --spec-synthetic-accept 2.5;X=1 --gpu-memory-utilization 0.8 --speculative-config $E3 --spec-synthetic-accept 2.5" $B ab-env
TEST_TIMEOUT=60 TESTS="tests/test_spec_device_drafts_kernel.py tests/test_fp8_gemm_mid.py" $B pytests-each
tar -czf "$OUT/results.tgz" -C /tmp/res .
