#!/usr/bin/env bash
# The fourth session's last device call, from the archived tree (.head) with ../.whl: the MoE
# post-attention norm in the router's launch off and on at one row; batch 1 plain and with the
# EAGLE-3 head (synthetic acceptance, the drafting steps graphed to the context's end); the GPU
# tests of the fused norm and the FP8 kernels' input range; the draft model's arm.
B="bash benchmarks/gpu_run.sh"
E4='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":4}'
D4='{"method":"draft_model","model":"slipstream/bench/configs/llama-3.2-1b/config.json","num_speculative_tokens":4}'
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=1 WORKLOADS="moe-30b-a3b-bs1" ARMS="SLIPSTREAM_MOE_FUSED_NORM=0;X=1" $B ab-env
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1;X=1 --gpu-memory-utilization 0.8 --speculative-config $E4 --spec-synthetic-accept 3" $B ab-env
TEST_TIMEOUT=100 TESTS="tests/test_moe_fused_norm.py tests/test_fp8_gemv_range.py tests/test_fp8_gemm_mid.py" $B pytests
REPS=1 WORKLOADS="seed-8b-bs1" ARMS="X=1 --gpu-memory-utilization 0.8 --speculative-config $D4 --spec-synthetic-accept 3" $B ab-env
tar -czf "$OUT/results.tgz" -C /tmp/res .
