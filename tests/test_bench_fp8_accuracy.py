"""benchmarks/fp8_accuracy.py on the CPU, on a tiny random Llama with SmolLM2's tokenizer: the
--smoke run (every arm, the JSON); the teacher-forced reading lines up with the tokens a
free run sampled (an off-by-one position would not); an arm equal to the reference agrees
everywhere with zero error; the bounds mark and fail an arm past them."""
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import fp8_accuracy as acc  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import make_tiny_chat_model  # noqa: E402

from slipstream import LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> str:
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the tiny model gains nothing from two, and on a busy 2-core machine
    OpenMP's barriers wait out scheduler quanta."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _prompts(folder: str, n: int) -> list[list[int]]:
    from slipstream.model.tokenizer import load_tokenizer
    tok = load_tokenizer(folder)
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in acc.PROMPTS[:n]]


@pytest.mark.slow  # every arm an engine of its own; the quick tier keeps one arm
def test_smoke_run_reports_every_arm(tiny_chat_model, tmp_path, capsys):
    assert acc.main(["--smoke", "--device", "cpu", "--model", tiny_chat_model, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name, _ in acc.ARMS)
    res = json.loads((tmp_path / "fp8_accuracy.json").read_text())
    ref = res["reference"]
    assert ref["positions"] == sum(ref["answer_tokens"]) > 0
    assert [a["arm"] for a in res["arms"]] == [name for name, _ in acc.ARMS]
    for a in res["arms"]:
        assert a["positions"] == ref["positions"]
        assert 0.0 <= a["greedy_agreement"] <= 1.0 and 0.0 <= a["identical_answers"] <= 3
        assert 0.0 < a["mean_abs_dlogprob"] <= a["max_abs_dlogprob"]  # quantized: the logprobs moved
        assert a["bound"] is None  # the bounds are SmolLM2's


@pytest.mark.slow
def test_teacher_forcing_reads_the_positions_a_free_run_sampled(tiny_chat_model):
    prompts = _prompts(tiny_chat_model, 2)
    llm = LLM(tiny_chat_model, device="cpu", max_model_len=512)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, logprobs=0))
    answers = [o.outputs[0].token_ids for o in outs]
    tf = acc.teacher_forced(llm, prompts, answers)
    for o, a, am, lp in zip(outs, answers, tf.argmax, tf.logprob):
        assert am == a  # the greedy tokens are each position's most likely token
        sampled = [d[t] for d, t in zip(o.outputs[0].logprobs, a)]
        assert lp == pytest.approx(sampled, abs=1e-4)


@pytest.mark.slow  # two engines; the quick tier keeps the teacher-forced reading and the bounds
def test_an_arm_equal_to_the_reference_agrees_everywhere(tiny_chat_model):
    args = SimpleNamespace(model=tiny_chat_model, device="cpu", dtype="float32", max_model_len=512, max_tokens=6)
    (same,), reference = acc.run(args, _prompts(tiny_chat_model, 2), [("same", {})])
    assert same.positions == reference["positions"] > 0
    assert same.greedy_agreement == 1.0 and same.max_abs_dlogprob == 0.0 and same.identical_answers == 2
    assert same.mean_first_difference is None


def test_bounds_mark_and_fail_an_arm_past_them():
    def result(name, agreement, dlogprob):
        return acc.ArmResult(name, {}, 100, agreement, dlogprob, 2 * dlogprob, 10, 5.0, 1.0)
    good, low, far = result("fp8 weights", 0.95, 0.05), result("fp8 kv cache", 0.85, 0.05), \
        result("fp8 weights + kv", 0.9, 0.3)
    assert acc.check_bounds([good], acc.BOUNDS) and good.within_bound
    assert not acc.check_bounds([good, low, far], acc.BOUNDS)
    assert [r.within_bound for r in (good, low, far)] == [True, False, False]
    assert "FAILED" in acc.table([good, low, far], {"control_agreement": 1.0}, 16)
    assert acc.first_difference([1, 2, 3], [1, 2, 4]) == 2 and acc.first_difference([1, 2], [1, 2, 5]) == 2
    assert acc.first_difference([1, 2], [1, 2]) is None


@pytest.mark.gpu
def test_gpu_smollm2_smoke(tmp_path):
    """The real SmolLM2 in bf16 on CUDA, every FP8 arm (gputests-smol picks it up); the full
    run with its bounds is gpu_run.sh's stage fp8-accuracy."""
    assert acc.main(["--smoke", "--device", "cuda", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fp8_accuracy.json").read_text())
    assert res["dtype"] == "bfloat16" and all(a["max_abs_dlogprob"] > 0 for a in res["arms"])
