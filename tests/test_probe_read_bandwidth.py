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
    assert "read kernel sum ok" in capsys.readouterr().out
