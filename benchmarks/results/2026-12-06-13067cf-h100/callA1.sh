#!/usr/bin/env bash
# Fifth session, call A1 (tree 13067cf from .head, ../.whl): the GPU tests of last session's
# unverified changes (FP8 quantizers' IEEE division, the speculative launchers' stream
# phases), kernel profiles of the one-row FP8 and MoE steps with PDL off (true kernel times),
# and the llguidance arm of small-256-json (its error, if it fails again).
B="bash benchmarks/gpu_run.sh"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
TEST_TIMEOUT=150 TESTS="tests/test_fp8_gemv_range.py tests/test_fp8_gemm_mid.py tests/test_fp8_gemv.py tests/test_gpu_fp8.py" $B pytests-each
TEST_TIMEOUT=170 TESTS="tests/test_gpu_spec_verify.py tests/test_gpu_spec_drafters.py tests/test_spec_draft_graphs.py tests/test_spec_gpu.py tests/test_gpu_spec.py" $B pytests-each
for c in llama-3.1-8b:1:512:fp8 qwen3-30b-a3b:1:512; do
  SLIPSTREAM_PDL=0 timeout 150 python3 benchmarks/profile_step.py --case $c 2>&1 | grep -v Warn | tee -a /tmp/res/profile-nopdl.log | tail -22 >> $OUT/log.txt
done
timeout 150 python3 -m slipstream.cli bench --workload small-256-json --mode async --no-measure --grammar-tokenizer ../.smoltok --structured-outputs-backend llguidance 2>&1 | tail -25 | tee /tmp/res/llg.log >> $OUT/log.txt
tar -czf "$OUT/results.tgz" -C /tmp/res .
