"""benchmarks/kernel_resources.py: the prefill kernel compiled for sm_90 without a GPU, its
registers and shared memory read back from the cubin."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kernel_resources as kr  # noqa: E402


def test_programs_an_sm_take_the_tightest_limit():
    assert kr.programs_per_sm(regs=128, shared=16384, warps=4) == 4  # 128 regs x 128 threads
    assert kr.programs_per_sm(regs=64, shared=100_000, warps=4) == 2  # shared memory
    assert kr.programs_per_sm(regs=32, shared=0, warps=32) == 2  # 64 warps an SM
    assert kr.programs_per_sm(regs=255, shared=82176, warps=4) == 2  # 255 -> 256 a thread


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the sm_90 compile runs on a CPU machine")
def test_wide_tiles_take_more_shared_memory_than_narrow_ones():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_resources.py"),
                        "--prefill", "narrow:wide_n=0", "--groups", "2"], capture_output=True,
                       text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in r.stdout.splitlines() if line.startswith("| default") or line.startswith("| narrow")}
    wide, narrow = rows["default"], rows["narrow"]
    assert (wide[2], wide[3], narrow[3]) == ("64", "64", "0")  # BLOCK_M, WIDE_N
    assert int(narrow[8]) < int(wide[8])  # shared bytes: 32-wide K/V tiles against 64-wide
    assert 0 < int(narrow[6]) <= 255 and 0 < int(wide[6]) <= 255  # registers a thread
