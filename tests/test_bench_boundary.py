"""benchmarks/bench_boundary.py's kernels compute what its check expects (interpreter, one
program: the persistent kernel's barrier is then its own add)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_boundary  # noqa: E402


@pytest.mark.parametrize("name", ["chain", "chain-pdl", "persistent"])
def test_every_value_is_the_phase_count_after_one_pass(name):
    _, check = bench_boundary.run_variant(name, nprog=1, phases=5, device="cpu")
    assert check == (5.0, 5.0)


def test_main_prints_the_table_and_succeeds(capsys):
    assert bench_boundary.main(["--phases", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| programs | chain | chain-pdl | persistent |" in out and "WRONG" not in out
