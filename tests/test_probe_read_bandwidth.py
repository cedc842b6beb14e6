"""benchmarks/probe_read_bandwidth.py: its read-only kernel (the bandwidth ceiling it reports)
sums what it reads, every element once, under the interpreter at toy sizes."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import probe_read_bandwidth as probe  # noqa: E402


@pytest.mark.parametrize("numel, programs, block", [(3000, 3, 256), (4096, 4, 1024), (100, 2, 64)])
def test_read_kernel_sums_every_element_once(numel, programs, block):
    x = torch.arange(numel, dtype=torch.float32) % 7 + 1  # exact in fp32: a missed or doubled slice shows
    out = torch.zeros(1)
    probe.read_sum(x, out, programs=programs, block=block, stages=1)
    assert out.item() == x.sum().item()


def test_main_on_the_cpu_checks_the_kernel(capsys):
    assert probe.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "read kernel sum ok" in out and "tile read sum ok" in out


@pytest.mark.parametrize("n, k, block_n, block_k, split", [(64, 96, 16, 32, 2), (32, 128, 32, 32, 1),
                                                          (48, 96, 16, 32, 3), (32, 112, 16, 32, 2)])
def test_tile_read_sums_every_word_once(n, k, block_n, block_k, split):
    """The FP8 GEMV's tile pattern (row blocks x slices of K) covers the weight exactly once,
    also where K is not a whole number of tiles (112 = 3.5 x 32: the last tile is masked)."""
    w = torch.randint(-1000, 1000, (n, k), dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    probe.tile_read(w, out, block_n=block_n, block_k=block_k, split=split, stages=1, warps=4)
    assert out.item() == w.sum().item()


def test_ncu_one_row_runs_its_six_launches_on_the_cpu(capsys):
    """benchmarks/ncu_one_row.py (the one-row kernels for Nsight Compute) at toy sizes: every
    launch runs, and the FP8 down product matches its reference."""
    import ncu_one_row
    assert ncu_one_row.main(["--device", "cpu"]) == 0
    assert "down fp8 gemv: max relative error" in capsys.readouterr().out
