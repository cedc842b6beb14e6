"""benchmarks/probe_gemm_host_cost.py makes the engine's two GEMM calls at the model's
weight shapes and prints one row per (weight, rows) (on the CPU: no capture column)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import probe_gemm_host_cost as probe  # noqa: E402


def test_the_calls_are_the_engines_linear_and_residual_addmm():
    w = probe.layer_weights("0.6b", "cpu", torch.float32)
    assert {n: tuple(t.shape) for n, t in w.items()} == {"qkv": (4096, 1024), "o": (1024, 2048),
                                                       "gate_up": (6144, 1024), "down": (1024, 3072)}
    x, out = torch.randn(3, 2048), torch.randn(3, 1024)
    before = out.clone()
    probe.gemm_call("o", x, w["o"], out)()  # in place: out += x W^T
    torch.testing.assert_close(out, before + x @ w["o"].t())
    y = probe.gemm_call("qkv", torch.randn(3, 1024), w["qkv"], out)()
    assert y.shape == (3, 4096)


def test_main_prints_a_row_per_weight_and_row_count(capsys):
    assert probe.main(["--rows", "1,2", "--calls", "2", "--device", "cpu"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| (cpu) |")]
    assert [r.split(" | ")[1:3] for r in rows] == [[n, str(k)] for k in (1, 2) for n in ("qkv", "o", "gate_up", "down")]
    assert all(r.endswith("| - |") for r in rows)  # no capture on the CPU
