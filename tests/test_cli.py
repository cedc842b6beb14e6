"""`slipstream generate` on the CPU with the embedded SmolLM2: a prompt, a JSONL batch job
whose bad lines fail alone, and clear errors (exit code 2) for bad flags and options."""
from __future__ import annotations

import json

import pytest

from slipstream import LLM
from slipstream.cli.main import main
from slipstream.config import EngineConfig, default_max_num_batched_tokens


@pytest.mark.slow
def test_generate_a_chat_prompt(capsys):
    assert main(["generate", "--device", "cpu", "--chat", "--max-tokens", "12",
                 "What is the capital of France?"]) == 0
    assert capsys.readouterr().out.strip() == "The capital of France is Paris."


@pytest.mark.slow
def test_batch_job_bad_lines_fail_alone(tmp_path):
    lines = [json.dumps({"id": "a", "prompt": "The capital of France is"}),
             json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 2}),
             "{not json",
             json.dumps({"prompt": "x", "messages": []}),
             json.dumps({"prompt": "x", "temperature": -1}),
             json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Hi"}]})]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n\n")
    # --batch-invariant is accepted everywhere (a no-op on the CPU, whose path is per row)
    assert main(["generate", "--device", "cpu", "--input", str(src), "--output", str(dst), "--quiet",
                 "--max-tokens", "4", "--batch-invariant"]) == 0
    rows = [json.loads(x) for x in dst.read_text().splitlines()]  # in the order they finished
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == sorted(["a", "2", "3", "4", "5", "chat"]) and len(rows) == 6
    assert by_id["a"]["generated_text"] == " Paris.\n\n" and by_id["a"]["finish_reason"] == "length"
    assert len(by_id["2"]["generated_tokens"]) == 2 and by_id["2"]["error"] is None
    assert "not valid JSON" in by_id["3"]["error"] and "exactly one of" in by_id["4"]["error"]
    assert by_id["5"]["error"] == "line 5: temperature must be >= 0, got -1.0"
    assert by_id["chat"]["num_input_tokens"] > 10 and len(by_id["chat"]["generated_tokens"]) == 4


@pytest.mark.parametrize("argv,message", [
    (["generate", "--device", "cpu", "--max-tokens", "0", "hi"], "max_tokens"),
    (["generate", "--device", "cpu"], "give a prompt argument"),
    (["generate", "--device", "cpu", "--max-num-seqs", "0", "hi"], "max_num_seqs"),
    (["generate", "--device", "cpu", "--cuda-graph-max-tokens", "-5", "hi"], "cuda_graph_max_tokens"),
])
def test_bad_flags_exit_2_with_a_clear_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_engine_config_names_the_bad_option():
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['batch_invariantt'\]"):
        EngineConfig.from_kwargs(batch_invariantt=True)
    assert EngineConfig.from_kwargs(batch_invariant=True).batch_invariant
    assert EngineConfig(cuda_graph_max_tokens=0).cuda_graph_max_tokens == 0  # 0: mixed steps eager
    with pytest.raises(ValueError, match="cuda_graph_max_tokens must be a positive integer"):
        EngineConfig(cuda_graph_max_tokens=1.5)


@pytest.mark.slow
def test_default_tokens_per_step_follow_the_device():
    # 16384 on 70 GiB+ GPUs (not the A100), 8192 elsewhere, never below max_num_seqs;
    # a given value is kept and checked
    h200 = 143 * 2**30
    assert default_max_num_batched_tokens("cuda", h200, "NVIDIA H200") == 16384
    assert default_max_num_batched_tokens("cuda", 80 * 2**30, "NVIDIA A100-SXM4-80GB") == 8192
    assert default_max_num_batched_tokens("cuda", 24 * 2**30, "NVIDIA L4") == 8192
    assert default_max_num_batched_tokens("cpu") == 8192
    assert default_max_num_batched_tokens("cpu", max_num_seqs=10000) == 10000
    assert EngineConfig().max_num_batched_tokens is None
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)
    llm = LLM(device="cpu", max_model_len=128)
    assert llm.engine.max_num_batched_tokens == llm.engine.scheduler.max_num_batched_tokens == 8192


@pytest.mark.slow  # two engines over a workload; the quick tier keeps `generate`
def test_bench_runs_sync_and_async_on_a_workload(tiny_model, tmp_path, monkeypatch, capsys):
    # `slipstream bench` end to end on the CPU (the tiny random model as a named workload):
    # both modes, identical outputs, the breakdown, the --max-num-batched-tokens override, and
    # (as a latency workload) the ms-per-step column and JSON key
    from slipstream.bench import workloads
    from slipstream.sampling.params import SamplingParams

    folder, _ = tiny_model("qwen3")
    prompts = [[(7 * i + j) % 90 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=4 + i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True) for i in range(6)]
    monkeypatch.setitem(workloads.WORKLOADS, "unit", lambda: workloads.Workload(
        "unit", folder, prompts, params, dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64),
        latency=True))
    assert main(["bench", "--workload", "unit", "--device", "cpu", "--max-num-batched-tokens", "16",
                 "--no-cuda-graph-clone", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| unit | sync |" in out and "| unit | async |" in out and "identical outputs: True" in out
    assert "| steps | ms per step |" in out
    summary = json.loads((tmp_path / "unit.json").read_text())
    assert summary["engine_options"]["max_num_batched_tokens"] == 16 and summary["identical_outputs"]
    assert summary["engine_options"]["max_num_seqs"] == 4  # the workload's, no flag given
    assert summary["engine_options"]["cuda_graph_clone"] is False
    async_run = summary["results"]["async"]
    assert async_run["output_tokens"] == sum(p.max_tokens for p in params)
    # 16 tokens per step: the 75 prompt tokens need at least 5 steps with a prefill chunk
    assert async_run["steps"] >= 5 + max(p.max_tokens for p in params) - 1
    assert async_run["breakdown"] == []  # CPU: no GPU spans to break down
    assert async_run["ms_per_step"] == pytest.approx(1e3 * async_run["wall_s"] / async_run["steps"])
    assert f"| {async_run['steps']} | {async_run['ms_per_step']:.2f} |" in out
    assert main(["bench", "--workload", "no-such-workload", "--device", "cpu"]) == 2
    assert main(["bench", "--workload", "unit", "--device", "cpu", "--block-size", "12"]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_prints_the_answer_as_it_is_generated(tokenized_tiny, monkeypatch):
    import io
    import sys

    from slipstream import SamplingParams

    writes = []

    class Recorder(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    monkeypatch.setattr(sys, "stdout", Recorder())
    argv = ["generate", "--model", tokenized_tiny, "--device", "cpu", "--max-model-len", "256",
            "--max-tokens", "12", "--ignore-eos", "--temperature", "0", "Once upon a time"]
    assert main(argv) == 0
    expected = LLM(tokenized_tiny, device="cpu", max_model_len=256).generate(
        "Once upon a time", SamplingParams(max_tokens=12, ignore_eos=True, temperature=0))[0].text
    assert "".join(writes) == expected + "\n"
    assert len([w for w in writes if w]) > 3  # piece by piece, not once at the end
