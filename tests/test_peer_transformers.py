"""benchmarks/peer_transformers.py, the transformers continuous-batching peer, checked on the CPU:
its `--smoke` run end to end on a tiny Qwen3-MoE of the moe-30b-a3b workload's architecture
(experts in grouped_mm), and the sizes it gives that workload on the GPU."""
from __future__ import annotations

import json
import os
import runpy
import sys

import pytest

from slipstream.bench.workloads import get_workload

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                      "peer_transformers.py")


def test_moe_workload_sizes_hold_every_request_at_once():
    peer = runpy.run_path(SCRIPT)  # its functions, without running main
    wl = get_workload("moe-30b-a3b")
    prompts = [list(p) for p in wl.prompts]
    d = peer["workload_defaults"](wl, prompts, wl.params[0].max_tokens)
    assert d["max_requests"] == 256 and d["cuda_graph"] == "off"
    assert d["num_blocks"] * 256 >= 256 * (256 + 256)  # KV for all requests' prompts and outputs
    dense = peer["workload_defaults"](get_workload("seed-8b-short"), prompts, 1024)
    assert dense["cuda_graph"] == "on" and dense["max_requests"] == 32


@pytest.mark.slow  # builds and runs a transformers model (about 2 s); the sizes above stay quick
def test_smoke_run_of_the_moe_peer_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--smoke", "--workload", "moe-30b-a3b", "--out", str(tmp_path)])
    runpy.run_path(SCRIPT, run_name="__main__")
    with open(tmp_path / "peer_transformers.json") as f:
        report = json.load(f)
    assert report["workload"] == "moe-30b-a3b"
    assert report["model_class"] == "Qwen3MoeForCausalLM"
    assert report["experts_implementation"] == "grouped_mm"
    (run,) = report["runs"]
    assert run["full_length"] and run["output_tokens"] == run["expected_tokens"] == 4 * 8
