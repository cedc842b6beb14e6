"""benchmarks/bench_spec_ngram_real.py on the CPU: its --smoke run on a tiny random Llama with
SmolLM2's tokenizer (the same chat prompts and tokens as the real model, a fraction of its
cost): plain and n-gram arms, greedy tokens equal, the counters read back consistently; a
differing arm is counted and fails the run."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_spec_ngram_real as bench  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import make_tiny_chat_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> str:
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the tiny model's ops gain nothing from two, and on a busy 2-core
    machine OpenMP's barriers wait out scheduler quanta (3 s a run becomes 20)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SMOKE = ["--smoke", "--device", "cpu", "--max-model-len", "512"]


@pytest.mark.slow  # both arms on every prompt; the quick tier keeps the one-prompt run
def test_smoke_run_compares_ngram_with_plain(tiny_chat_model, tmp_path, capsys):
    assert bench.main(SMOKE + ["--model", tiny_chat_model, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "greedy outputs equal to plain: yes" in out and "| ngram k=2 |" in out
    res = json.loads((tmp_path / "bench_spec_ngram_real.json").read_text())
    plain, spec = res["arms"]
    assert plain["arm"] == "plain" and spec["speculative_config"] == bench.ngram_config(2)
    assert len(plain["tokens"]) == len(spec["tokens"]) == 2 == len(res["prompt_tokens"])
    assert all(n > 200 for n in res["prompt_tokens"])  # the grounded texts, through the chat template
    assert spec["tokens"] == plain["tokens"] and spec["mismatches"] == 0
    for arm in (plain, spec):
        assert arm["output_tokens"] == sum(map(len, arm["tokens"])) == 2 * 12  # ignore_eos is off: never EOS (2) here
        assert arm["tokens_per_s"] > 0 and arm["steps"] >= 2
    assert plain["drafted"] == 0 and plain["mean_accepted_length"] is None
    # every verification emits 1..k+1 tokens a drafting row; the counters are this run's
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert 1.0 <= spec["mean_accepted_length"] <= 3.0
    assert spec["steps"] < plain["steps"] or spec["accepted"] == 0


@pytest.mark.slow  # both arms, an engine each
def test_a_differing_arm_is_counted_and_fails_the_run(tiny_chat_model, monkeypatch, capsys):
    real = bench.run_one

    def spec_arm_off_by_one(llm, prompt, params):
        tokens, *rest = real(llm, prompt, params)
        if llm.engine.scheduler.speculative is not None and params.max_tokens == 12:
            tokens = tokens[:-1] + [tokens[-1] + 1]
        return (tokens, *rest)
    monkeypatch.setattr(bench, "run_one", spec_arm_off_by_one)
    assert bench.main(SMOKE + ["--model", tiny_chat_model, "--num-prompts", "1"]) == 1
    assert "NO, 1 requests differ" in capsys.readouterr().out


@pytest.mark.slow  # a bench run of four engines
def test_timeline_prints_each_arms_host_and_gpu_time_per_step(tiny_chat_model, tmp_path, capsys):
    """--timeline: the per-step table, and in the JSON each arm's host phases (the CPU has no
    GPU lane and no graphs: its verification steps all run eagerly)."""
    assert bench.main(SMOKE + ["--model", tiny_chat_model, "--num-prompts", "1", "--timeline",
                               "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| arm | steps | schedule ms | launch ms |" in out
    plain, spec = json.loads((tmp_path / "bench_spec_ngram_real.json").read_text())["arms"]
    for arm in (plain, spec):
        p = arm["per_step"]
        assert p["steps"] >= arm["steps"] - 1 and p["launch_ms"] > 0 and p["gpu_ms"] is None
        assert p["host_ms"] == pytest.approx(p["schedule_ms"] + p["launch_ms"] + p["process_ms"])
        assert p["verify_replays"] == 0 and p["capture_s"] == 0.0
    assert plain["per_step"]["verify_steps"] == 0
    assert spec["per_step"]["verify_steps"] > 0 and spec["per_step"]["eager_verify_steps"] == spec["per_step"]["verify_steps"]
    assert f"| ngram k=2 | {spec['per_step']['steps']} |" in out


@pytest.mark.gpu
def test_gpu_smollm2_smoke(tmp_path):
    """The real SmolLM2 on CUDA under graphs (gputests-smol picks it up); the full run is
    gpu_run.sh's stage spec-real."""
    assert bench.main(["--smoke", "--device", "cuda", "--out", str(tmp_path)]) == 0
    plain, spec = json.loads((tmp_path / "bench_spec_ngram_real.json").read_text())["arms"]
    assert spec["tokens"] == plain["tokens"] and spec["drafted"] > 0
