"""benchmarks/profile_bench.py on the CPU: a bench workload of the tiny random model, plain and
with n-gram speculation, profiled for a few steady-state steps (the CPU ops' self times stand
for the kernels)."""
from __future__ import annotations

import json
import os
import sys

from types import SimpleNamespace

import pytest

from slipstream import SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import profile_bench  # noqa: E402
from profile_step import KINDS  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.fixture
def unit_workload(tiny_model, monkeypatch):
    from slipstream.bench import workloads

    folder, _ = tiny_model("llama")
    prompts = [[(5 * i + j) % 40 + 3 for j in range(8 + 4 * i)] for i in range(3)]
    params = [SamplingParams(max_tokens=100, temperature=0, ignore_eos=True) for _ in prompts]
    monkeypatch.setitem(workloads.WORKLOADS, "profile-unit", lambda: workloads.Workload(
        "profile-unit", folder, prompts, params, dict(max_num_seqs=4, max_model_len=128)))
    return "profile-unit"


def _run(workload: str, tmp_path, capsys, *extra: str) -> tuple[dict, str]:
    argv = ["--workload", workload, "--device", "cpu", "--steps", "4", "--settle", "2", "--warmup-steps", "1",
            "--top", "5", "--out", str(tmp_path), *extra]
    assert profile_bench.main(argv) == 0
    out = capsys.readouterr().out
    return json.loads((tmp_path / f"profile_bench_{workload}.json").read_text()), out


@pytest.mark.slow
@pytest.mark.parametrize("spec", [False, True])
def test_profile_bench_reports_steady_steps_by_kind_and_range(unit_workload, tmp_path, capsys, spec):
    extra = ("--speculative-config", json.dumps(NGRAM)) if spec else ()
    r, out = _run(unit_workload, tmp_path, capsys, *extra)
    assert r["steps"] == 4 and len(r["per_step"]) == 4 and r["mode"] == "async" and not r["on_gpu"]
    assert r["engine_options"]["cuda_graph_clone"] is False  # (every graph launch visible to the profiler)
    # the window starts once every prompt is in: its steps are decode (or verify) steps
    assert r["settle_steps"] >= 3
    assert all(not g.startswith("with prefill") for g in r["step_groups"])
    assert sum(r["step_groups"].values()) == 4
    if spec:
        assert r["engine_options"]["speculative_config"] == json.dumps(NGRAM)
        assert any(g.startswith("verify") for g in r["step_groups"])
        assert r["by_range"]["acceptance"]["us"] > 0
    # (on the CPU no graphs: the eager step's forward and sampling, its innermost ranges)
    assert r["by_range"]["forward"]["us"] > 0 and r["by_range"]["sample"]["us"] > 0
    # the wrapped functions are themselves again (the module's and the runner class's)
    from slipstream.runner import model_runner, speculative
    assert speculative.verify.__module__ == "slipstream.runner.speculative" and not hasattr(speculative.verify,
                                                                                             "__wrapped__")
    assert not hasattr(model_runner.launch_speculative, "__wrapped__")
    assert r["outside"]["unmatched"] == 0
    kinds = {k for k, _ in KINDS} | {"other"}
    assert r["by_kind"] and set(r["by_kind"]) <= kinds
    assert r["by_kind"]["gemm"]["per_step"] > 0  # the decoder's matmuls, every step
    # the per-kind and per-range sums are the kernel time; the kernels ran inside the steps
    assert sum(v["us"] for v in r["by_kind"].values()) == pytest.approx(r["kernel_us"])
    assert sum(v["us"] for v in r["by_range"].values()) == pytest.approx(r["kernel_us"])
    assert sum(v["per_step"] for v in r["by_kind"].values()) == pytest.approx(r["kernels_per_step"])
    for s in r["per_step"]:
        assert 0 < s["kernel_us"] <= s["wall_us"] and s["kernels"] > 0
    assert r["kernel_us_min"] <= r["kernel_us"] <= r["kernel_us_max"]
    assert "launch" in r["by_range"] and "launch" in r["ranges"] and "eager step" in r["ranges"]
    assert len(r["top"]) == 5 and r["top"][0]["us"] >= r["top"][-1]["us"]
    assert r["top"][0]["per_step"] > 0 and r["unprofiled_wall_us"] > 0
    assert f"## profile-bench {unit_workload} (async, cpu): 4 steps" in out
    assert "| gemm |" in out and "| launch |" in out


@pytest.mark.slow
def test_profile_bench_flags_and_a_workload_too_short(unit_workload, tmp_path, capsys):
    assert profile_bench.main(["--workload", unit_workload, "--device", "cpu", "--steps", "0"]) == 2
    assert "--steps and --settle must be >= 1" in capsys.readouterr().err
    # 100 tokens a request: 200 settling steps never come
    assert profile_bench.main(["--workload", unit_workload, "--device", "cpu", "--settle", "200"]) == 2
    assert "the workload ended after" in capsys.readouterr().err


def test_intervals_find_the_innermost_span():
    spans = profile_bench.Intervals([(0, 10, "a"), (1, 4, "b"), (2, 3, "c"), (5, 6, "d"), (20, 30, "e")])
    assert [spans.at(t) for t in (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 7, 15, 25, 31, -1)] == \
        ["a", "b", "c", "b", "a", "d", "a", None, "e", None, None]


def _ev(name, start, end, device="cpu", id=0, activity=None, linked=0, self_us=0.0, thread=1):
    import torch
    dt = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=dt, id=id,
                           activity_type=activity, linked_correlation_id=linked, self_cpu_time_total=self_us,
                           thread=thread)


def test_gpu_kernels_count_towards_the_step_and_range_of_their_launch():
    """The GPU path on made-up profiler events: a kernel belongs to the step and innermost range
    whose time holds its launch call (matched by correlation id), whenever the kernel ran; a
    graph's kernels to the graph launch; a kernel without a launch call to its linked op."""
    S, R = profile_bench.STEP, profile_bench.RANGE
    events = [
        _ev(S + "0", 0, 100, id=1), _ev(R + "launch", 5, 90, id=2), _ev(R + "decode graph", 10, 20, id=3),
        _ev("cudaGraphLaunch", 11, 12, id=500, activity="cuda_runtime"),
        _ev("cudaMemcpyAsync", 30, 31, id=501, activity="cuda_runtime"),
        _ev(S + "1", 100, 200, id=4), _ev(R + "launch", 105, 190, id=5), _ev("aten::mm", 110, 120, id=6),
        _ev("cuLaunchKernelEx", 111, 112, id=502, activity="cuda_driver"),
        _ev("cudaLaunchKernel", -50, -49, id=503, activity="cuda_runtime"),  # before the window
        # kernels (they run later than their launches: async)
        _ev("_gemv_kernel", 150, 160, "cuda", id=500), _ev("_decode_kernel", 160, 165, "cuda", id=500),
        _ev("Memcpy HtoD (Pinned -> Device)", 170, 171, "cuda", id=501),
        _ev("nvjet_hsh_gemm", 250, 270, "cuda", id=502), _ev("_rms_norm_kernel", 10, 12, "cuda", id=503),
        _ev("_sample_kernel", 280, 283, "cuda", id=999, linked=6),  # no launch event: the linked op's
        _ev(R + "launch", 150, 170, "cuda", activity="gpu_user_annotation"),  # not kernels
        _ev("Stream Wait Event", 150, 170, "cuda", id=500, activity="cuda_sync"),
    ]
    records, outside = profile_bench.kernel_records(events, on_gpu=True)
    assert sorted(records) == sorted([(0, "decode graph", "_gemv_kernel", 10), (0, "decode graph", "_decode_kernel", 5),
                                      (0, "launch", "Memcpy HtoD (Pinned -> Device)", 1),
                                      (1, "launch", "nvjet_hsh_gemm", 20), (1, "launch", "_sample_kernel", 3)])
    assert outside == {"us": 2, "kernels": 1, "unmatched": 0}
    r = profile_bench.summarize(records, [100e-6, 100e-6], ["decode 1-16", "decode 1-16"], top=3)
    assert r["kernel_us"] == pytest.approx(19.5) and r["kernels_per_step"] == 2.5
    assert r["kernel_us_min"] == 16 and r["kernel_us_max"] == 23
    assert r["by_kind"]["gemm"] == {"per_step": 1.0, "us": 15.0}
    assert r["by_kind"]["memcpy"]["us"] == 0.5 and r["by_kind"]["attention"]["us"] == 2.5
    assert r["by_range"]["decode graph"] == {"per_step": 1.0, "us": 7.5}
    assert [t["name"] for t in r["top"]] == ["nvjet_hsh_gemm", "_gemv_kernel", "_decode_kernel"]
    assert r["per_step"][1] == {"wall_us": 100.0, "kernel_us": 23, "kernels": 2, "group": "decode 1-16"}


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [False, True])
def test_profile_bench_on_the_gpu_matches_every_kernel_to_its_launch(unit_workload, tmp_path, capsys, spec):
    """On a GPU: CUDA kernels, each matched to the launch call of a profiled step (none
    unmatched), the plain steps' kernels under the decode graph's replay, the speculative
    steps' under a verification range (synthetic acceptance: every row drafts, as n-gram
    drafting on the GPU finds nothing in the unit workload's random prompts).  Both IO slots'
    graphs are captured (a clone's driver-API launch is not in the profile)."""
    extra = ("--speculative-config", json.dumps(NGRAM), "--spec-synthetic-accept", "1") if spec else ()
    argv = ["--workload", unit_workload, "--device", "cuda", "--steps", "8", "--out", str(tmp_path), *extra]
    assert profile_bench.main(argv) == 0
    r = json.loads((tmp_path / f"profile_bench_{unit_workload}.json").read_text())
    assert r["on_gpu"] and r["steps"] == 8 and r["outside"]["unmatched"] == 0
    assert all(s["kernels"] > 0 and s["kernel_us"] > 0 for s in r["per_step"])
    assert r["by_kind"]["gemm"]["per_step"] >= 1
    assert r["kernel_us"] < 3 * r["wall_us"]  # (three streams may overlap; not more)
    if spec:
        assert any(g.startswith("verify") for g in r["step_groups"])
        assert {"verify", "verify graph"} & set(r["by_range"])
    else:
        assert r["by_range"]["decode graph"]["us"] > 0.5 * r["kernel_us"]
