#!/usr/bin/env bash
# Fifth session, call B1 (tree in .head/COMMIT): the FP8 tests after the reference-scale fix;
# small-256 and its constrained variants on one host after xgrammar stopped seeing the
# logits' padded ids (GrammarVocab), in-process and with workers, and llguidance after its
# stop-id fix.
B="bash benchmarks/gpu_run.sh"
G="--grammar-tokenizer ../.smoltok"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
REPS=1 WORKLOADS="small-256" ARMS="X=1" $B ab-env
REPS=1 WORKLOADS="small-256-json" ARMS="X=1 $G;X=1 $G --structured-outputs-workers 0;X=1 $G --structured-outputs-backend llguidance" $B ab-env
REPS=1 WORKLOADS="small-256-json-half" ARMS="X=1 $G" $B ab-env
TEST_TIMEOUT=120 TESTS="tests/test_fp8_gemv_range.py tests/test_fp8_gemm_mid.py" $B pytests-each
tar -czf "$OUT/results.tgz" -C /tmp/res .
