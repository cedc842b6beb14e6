"""benchmarks/bench_fp8_skinny.py and bench_fp8_gemv.py at toy sizes under Triton's
interpreter (`--tiny`), in a subprocess (the interpreter is chosen before Triton is imported):
every implementation runs, passes the bench's own check and lands in the JSON record."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(script: str, args: list[str], out: str) -> dict:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--tiny", "--jobs", "1",
                        "--no-default-variants", "--out", out, *args],
                       capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "FAILED" not in r.stdout, r.stdout[-3000:]
    with open(os.path.join(out, script.replace(".py", ".json"))) as f:
        return json.load(f)


@pytest.mark.subprocess
def test_skinny_bench_runs_each_implementation_at_one_and_twenty_rows(tmp_path):
    rec = _bench("bench_fp8_skinny.py", ["--rows", "1,20", "--groups", "64"], str(tmp_path))
    timed = {(r["shape"], r["m"], r["impl"]) for r in rec["rows"] if "us" in r}
    for shape in ("qkv", "down"):
        for m in (1, 20):
            # skinny-g64 is timed only once it matched its per-group reference
            assert {(shape, m, impl) for impl in ("bf16", "mm", "mm-fast", "fp8", "skinny", "skinny-g64")} <= timed


@pytest.mark.subprocess
def test_gemv_bench_sums_the_layer_at_one_row(tmp_path):
    rec = _bench("bench_fp8_gemv.py", ["--shapes", "qkv,o,gate_up,down"], str(tmp_path))
    timed = {(r["shape"], r["m"], r["impl"]) for r in rec["rows"] if "us" in r}
    assert {(s, 1, impl) for s in ("qkv", "o", "gate_up", "down") for impl in ("bf16", "fp8")} <= timed
