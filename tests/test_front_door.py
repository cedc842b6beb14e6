"""A request is validated once, at the front door (`frontend.prompts.validate_request`), and
the core keeps an O(1) guard: bad requests never reach the core's add, SamplingParams.from_dict
runs once per engine request, and a malformed AddRequest that does reach the core fails alone."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
from fake_async_llm import FakeAsyncLLM, run_app
from helpers import drain_core

import slipstream.frontend.prompts as prompts
from slipstream.core.messages import AddRequest, CoreInfo
from slipstream.frontend.data_parallel import DataParallelLLM
from slipstream.frontend.prompts import RequestRejected, ValidatedRequest, validate_request
from slipstream.sampling.params import SamplingParams

INFO = CoreInfo(model_name="m", max_model_len=64, vocab_size=100, eos_token_ids=[2], num_kv_blocks=3,
                block_size=16, device="cpu", async_scheduling=False, max_num_batched_tokens=64)


@pytest.mark.parametrize("prompt, max_tokens, words", [
    ([], 1, "the prompt is empty"),
    ([5, 100], 1, "prompt token id 100 is outside the vocabulary [0, 100)"),
    ([5, -1], 1, "prompt token id -1 is outside"),
    ([5] * 60, 10, "is 70 tokens, more than max_model_len=64"),
    ([5] * 40, 10, "needs 4 KV blocks, but the whole KV cache has 3"),
])
def test_the_front_door_names_the_problem_in_one_line(prompt, max_tokens, words):
    with pytest.raises(RequestRejected) as e:
        validate_request(prompt, SamplingParams(max_tokens=max_tokens), None, INFO)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert e.value.prompt_token_ids == prompt and e.value.params.max_tokens == max_tokens
    out = e.value.output("r", 0.0)
    assert out.finished and out.error == str(e.value) and out.finish_reason == "error"


def test_the_front_door_accepts_a_prompt_that_fits():
    params = SamplingParams(max_tokens=8)
    request = validate_request((3, 4, 5), params, None, INFO)
    assert request == ValidatedRequest(None, [3, 4, 5], params) and request.params is params
    with pytest.raises(TypeError, match="token ids"):
        validate_request([1, True], None, None, INFO)
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        validate_request([1], {"max_tokens": 2}, None, INFO)
    with pytest.raises(ValueError, match="no tokenizer"):
        validate_request("text", None, None, INFO)


def test_from_validated_rebuilds_params_without_checking_them_again(monkeypatch):
    params = SamplingParams(max_tokens=7, stop=["x", "y"], stop_token_ids=[4], top_k=-1, seed=3)
    wire = params.to_dict()
    checks = []
    monkeypatch.setattr(SamplingParams, "_validate_and_normalise", lambda self: checks.append(self))
    again = SamplingParams.from_validated(wire)
    assert again == params and again.stop == ("x", "y") and not checks
    with pytest.raises(ValueError, match="exactly the fields"):
        SamplingParams.from_validated({k: v for k, v in wire.items() if k != "top_p"})
    with pytest.raises(ValueError, match="exactly the fields"):
        SamplingParams.from_validated(dict(wire, best_of=2))


def _counting(monkeypatch, owner, name):
    calls = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


def test_the_server_validates_each_prompt_once_and_passes_the_validated_request(monkeypatch):
    from_dict = _counting(monkeypatch, SamplingParams, "from_dict")
    fake = FakeAsyncLLM()
    validated = _counting(monkeypatch, fake, "validate")
    checked = _counting(monkeypatch, prompts, "admission_error")
    received = []
    generate = fake.generate

    def recording(prompt, *args, **kwargs):
        received.append(prompt)
        return generate(prompt, *args, **kwargs)
    fake.generate = recording

    async def body(c, llm):
        r = await c.post("/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json={"prompt": [5, 999], "max_tokens": 2})
        assert r.status_code == 400 and "prompt token id 999 is outside the vocabulary" in r.text
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 2})
        assert r.status_code == 200, r.text
    run_app(body, llm=fake)
    assert len(validated) == len(checked) == len(from_dict) == 4  # (2 prompts, the bad one, the chat)
    assert len(received) == 3 and all(isinstance(p, ValidatedRequest) for p in received)


def test_data_parallel_validates_once_and_hands_replicas_the_validated_request(monkeypatch):
    replicas = [FakeAsyncLLM(), FakeAsyncLLM()]
    replicas[1].info = msgspec.structs.replace(replicas[1].info, num_kv_blocks=2)
    dp = DataParallelLLM(lambda i: replicas[i], 2)
    assert dp.info.num_kv_blocks == 2  # the smallest replica's cache: admitted anywhere it is routed
    checked = _counting(monkeypatch, prompts, "admission_error")
    received, replica_validations = [], []
    for r in replicas:
        _spy_generate(r, received)
        replica_validations += [_counting(monkeypatch, r, "validate")]

    async def main():
        good = [out async for out in dp.generate("hello", SamplingParams(max_tokens=2))]
        bad = [out async for out in dp.generate("x" * 40, SamplingParams(max_tokens=2))]  # 3 blocks > 2
        await dp.shutdown()
        return good, bad
    good, bad = asyncio.run(main())
    assert good[-1].finished and good[-1].finish_reason == "length"
    assert len(bad) == 1 and bad[0].finish_reason == "error" and "KV blocks" in bad[0].error
    assert len(checked) == 2 and not any(replica_validations)
    assert len(received) == 1 and isinstance(received[0], ValidatedRequest)


def _spy_generate(replica, received: list) -> None:
    generate = replica.generate

    def recording(prompt, *args, **kwargs):
        received.append(prompt)
        return generate(prompt, *args, **kwargs)
    replica.generate = recording


def test_a_bad_request_never_reaches_the_core_and_from_dict_never_runs(tokenized_tiny, monkeypatch):
    from slipstream.frontend.llm import LLM
    llm = LLM(tokenized_tiny, device="cpu", max_model_len=64)
    added: list[AddRequest] = _counting(monkeypatch, llm.engine, "add")
    from_dict = _counting(monkeypatch, SamplingParams, "from_dict")
    checked = _counting(monkeypatch, prompts, "admission_error")
    outs = llm.generate([[5] * 60, [3, 10 ** 9], [], [5, 6, 7]],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["error", "error", "error", "length"]
    assert len(checked) == 4 and not from_dict
    assert [msg.prompt_token_ids for (msg,) in added] == [[5, 6, 7]]


def test_the_cores_guard_fails_a_malformed_request_alone(tokenized_tiny):
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore
    core = EngineCore(EngineConfig(model=tokenized_tiny, device="cpu", max_model_len=64, max_num_seqs=4))
    good = SamplingParams(max_tokens=3, ignore_eos=True).to_dict()
    core.add(AddRequest("missing-field", [5, 6], {k: v for k, v in good.items() if k != "top_p"}))
    core.add(AddRequest("too-long", [5] * 62, good))  # 62 + 3 > 64
    core.add(AddRequest("empty", [], good))
    core.add(AddRequest("wrong-type", [5, 6], dict(good, max_tokens="3")))
    core.add(AddRequest("fine", [5, 6], good))
    ends, tokens = drain_core(core)
    assert ends["fine"] == ("length", None) and len(tokens["fine"]) == 3
    assert "malformed request" in ends["missing-field"][1] and "top_p" in ends["missing-field"][1]
    assert "max_model_len=64" in ends["too-long"][1] and "empty" in ends["empty"][1]
    assert ends["wrong-type"][0] == "error" and "malformed request" in ends["wrong-type"][1]
    assert not core.requests
