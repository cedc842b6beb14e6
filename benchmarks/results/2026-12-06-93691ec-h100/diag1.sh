#!/usr/bin/env bash
# The fourth session's first device call (diagnostics), run from the archived tree (.head) with
# ../.whl and ../.smoltok beside it: where the one-row MoE and FP8 steps lose their time, where
# the constrained workload's CPU goes, the one-token MoE tile sweep, the GPU tests not yet run.
B="bash benchmarks/gpu_run.sh"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
R=/tmp/res
(timeout 230 python3 benchmarks/profile_step.py --case qwen3-30b-a3b:1:512 --case llama-3.1-8b:1:512:fp8 --case llama-3.1-8b:1:512 --out $R > $R/profile-bs1.log 2>&1; echo "profile rc=$?" >> $R/profile-bs1.log)
(timeout 150 python3 benchmarks/profile_cpu.py --workload small-256-json --structured-outputs-workers 0 --grammar-tokenizer ../.smoltok --top 45 > $R/profile-cpu-json.log 2>&1; echo "rc=$?" >> $R/profile-cpu-json.log)
(timeout 100 python3 benchmarks/bench_moe.py --small-variants --with-router --tokens 1 --out $R/moe-small.json > $R/moe-small.log 2>&1; echo "rc=$?" >> $R/moe-small.log)
TEST_TIMEOUT=100 TESTS="tests/test_gpu_spec_drafters.py tests/test_fp8_gemm_mid.py" $B pytests-each
tar -czf "$OUT/results.tgz" -C /tmp/res .
cd /tmp/res || exit 0
for f in pytest-*.log; do echo "$f: $(tail -1 "$f")"; grep -E "^(FAILED|ERROR)" "$f" | head -5; done
grep -v "^\s*$" profile-bs1.log | head -90
tail -30 moe-small.log
