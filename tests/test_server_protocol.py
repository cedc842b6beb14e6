"""The server's protocol logic against a fake engine (tests/fake_async_llm.py), in process
through httpx's ASGI transport: response shapes, echo + legacy logprobs, choice indices,
streaming order, --stream-interval, admission (--max-waiting) and error objects."""
from __future__ import annotations

import asyncio
import json
import pytest

from fake_async_llm import FakeAsyncLLM, run_app


run = run_app


def events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completion_shape_and_indices():
    async def body(c, llm):
        r = await c.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3})
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["id"].startswith("cmpl-") and d["object"] == "text_completion"
        assert d["model"] == "fake-model" and isinstance(d["created"], int)
        assert [ch["index"] for ch in d["choices"]] == [0, 1, 2, 3]
        assert [ch["text"] for ch in d["choices"]] == ["Hel", "ell", "Hel", "ell"]
        assert all(ch["finish_reason"] == "length" for ch in d["choices"])
        assert d["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}
    run(body)


def test_echo_logprobs_legacy_layout_and_max_tokens_zero():
    async def body(c, llm):
        r = await c.post("/v1/completions", json={"prompt": "xyz", "max_tokens": 2, "echo": True,
                                                  "logprobs": 1, "temperature": 0})
        ch = r.json()["choices"][0]
        assert ch["text"] == "xyzHe"
        lp = ch["logprobs"]
        assert lp["tokens"] == ["x", "y", "z", "H", "e"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
        assert lp["text_offset"] == [0, 1, 2, 3, 4]
        assert all(len(t) == 2 for t in lp["top_logprobs"][1:])  # the token and the top-1
        r = await c.post("/v1/completions", json={"prompt": [91, 92], "max_tokens": 0,
                                                  "echo": True, "logprobs": 0})
        d = r.json()
        assert r.status_code == 200, d
        assert d["choices"][0]["text"] == "XY" and d["usage"]["completion_tokens"] == 0
        assert d["choices"][0]["logprobs"]["tokens"] == ["X", "Y"]
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
        assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
    run(body)


def test_streaming_completion_interval_and_usage():
    async def body(c, llm):
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 5, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        ev = events(r.text)
        assert ev[-1] == "[DONE]"
        usage = ev[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
        chunks = ev[:-2]
        assert "".join(e["choices"][0]["text"] for e in chunks) == "Hello"
        assert [len(e["choices"][0]["text"]) for e in chunks] == [2, 2, 1]  # the last: at finish
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    run(body, stream_interval=2)


def test_streaming_chat_role_first_then_finish():
    async def body(c, llm):
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 3, "n": 2, "stream": True, "logprobs": True,
            "top_logprobs": 2})
        ev = events(r.text)
        assert ev[-1] == "[DONE]"
        by_choice: dict[int, list] = {}
        for e in ev[:-1]:
            assert e["object"] == "chat.completion.chunk" and e["id"].startswith("chatcmpl-")
            ch = e["choices"][0]
            by_choice.setdefault(ch["index"], []).append(ch)
        assert sorted(by_choice) == [0, 1]
        for chs in by_choice.values():
            assert chs[0]["delta"] == {"role": "assistant", "content": ""}
            assert chs[-1]["finish_reason"] == "length"
            assert all(ch["finish_reason"] is None for ch in chs[:-1])
            assert all(len(t["top_logprobs"]) == 2 for ch in chs[1:]
                       for t in ch["logprobs"]["content"])
        assert "".join(ch["delta"]["content"] for ch in by_choice[0]) == "Hel"
    run(body)


def test_chat_non_streaming_stop_string():
    async def body(c, llm):
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "max_tokens": 10, "stop": ["lo"]})
        d = r.json()
        assert d["object"] == "chat.completion"
        ch = d["choices"][0]
        assert ch["message"] == {"role": "assistant", "content": "Hel", "refusal": None,
                                 "tool_calls": [], "reasoning_content": None, "reasoning": None}
        assert ch["finish_reason"] == "stop" and ch["stop_reason"] == "lo"
        prompt = llm.tokenizer.apply_chat_template([{"role": "system", "content": "s"},
                                                    {"role": "user", "content": "u"}])
        assert d["usage"]["prompt_tokens"] == len(prompt)
    run(body)


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 300}, 400, "256"),
    ("/v1/completions", {"prompt": [1, 999]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "a", "model": "nope"}, 404, "nope"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/completions", {"prompt": "a" * 5000}, 413, "limit"),
])
def test_errors(path, body, status, needle):
    async def go(c, llm):
        r = await c.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
        assert needle in err["message"]
    run(go)


def test_max_waiting_refuses_with_retry_after():
    async def body(c, llm):
        async def one():
            return await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 20})
        rs = await asyncio.gather(*(one() for _ in range(8)))
        codes = sorted(r.status_code for r in rs)
        assert codes == [200] * 3 + [503] * 5, codes  # 2 running + 1 waiting admitted
        assert all(r.headers["retry-after"] for r in rs if r.status_code == 503)
        assert len(llm.finished) == 3
    run(body, llm=FakeAsyncLLM(max_num_seqs=2, token_delay=0.01), max_waiting=1, max_num_seqs=2)


def test_metrics_names_and_counts():
    async def body(c, llm):
        await c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "n": 2})
        text = (await c.get("/metrics")).text
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                     "num_preemptions_total", "prefix_cache_queries_total",
                     "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
                     "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_count",
                     "request_queue_time_seconds_sum"):
            assert f"slipstream:{name}" in text, name
        assert 'slipstream:generation_tokens_total{model_name="fake-model"} 6.0' in text
        assert 'slipstream:prompt_tokens_total{model_name="fake-model"} 2.0' in text
        assert ('slipstream:request_success_total{finished_reason="length",'
                'model_name="fake-model"} 2.0') in text
    run(body)


def test_tokenize_detokenize_and_info():
    async def body(c, llm):
        r = (await c.post("/tokenize", json={"prompt": "hi"})).json()
        assert r == {"count": 2, "max_model_len": 256, "tokens": [107, 108], "token_strs": None}
        r = (await c.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})).json()
        assert r["tokens"] == llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
        assert (await c.post("/detokenize", json={"tokens": [107, 108]})).json() == {"prompt": "hi"}
        info = (await c.get("/tokenizer_info")).json()
        assert info["eos_token"] == "</s>" and info["model_max_length"] == 256
        assert (await c.get("/health")).status_code == 200
        llm.dead_error = "boom"
        assert (await c.get("/health")).status_code == 503
        r = await c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and "dead" in r.json()["error"]["message"]
    run(body)


def test_api_key_only_on_v1():
    async def body(c, llm):
        assert (await c.get("/v1/models")).status_code == 401
        bad = await c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m1"
        assert (await c.get("/health")).status_code == 200
        r = await c.post("/v1/completions", json={"prompt": "a", "model": "m2", "max_tokens": 1},
                         headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200 and r.json()["model"] == "m1"
    run(body, api_key="k3y", served_model_name=["m1", "m2"])


class _FailingLLM(FakeAsyncLLM):
    """Yields one output, then the engine fails."""

    async def generate(self, prompt, sampling_params=None, request_id=None, **output_options):
        async for out in super().generate(prompt, sampling_params, request_id, **output_options):
            yield out
            raise RuntimeError("core exploded")


def test_error_mid_stream_is_an_error_event_then_done():
    async def body(c, llm):
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True})
        ev = events(r.text)
        assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
        assert ev[-1] == "[DONE]" and "core exploded" in ev[-2]["error"]["message"]
        assert ev[-2]["error"]["code"] == 500
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 500 and "core exploded" in r.json()["error"]["message"]
    run(body, llm=_FailingLLM())


def test_non_streaming_disconnect_aborts():
    """The handler is raced against the ASGI disconnect: the engine request is aborted."""
    from slipstream.server.app import race_disconnect
    from slipstream.server.serving_common import ServingState, collect

    async def main():
        llm = FakeAsyncLLM(token_delay=0.01)
        state = ServingState(llm=llm, served_names=["m"])
        msgs = asyncio.Queue()

        class Req:  # the part of starlette's Request that race_disconnect uses
            async def receive(self):
                return await msgs.get()

        from slipstream.sampling.params import SamplingParams
        coro = collect(state, [llm.validate([70, 71], SamplingParams(max_tokens=200))], "r1")
        task = asyncio.ensure_future(race_disconnect(Req(), coro))
        await asyncio.sleep(0.1)
        assert llm.running == 1
        msgs.put_nowait({"type": "http.disconnect"})
        resp = await asyncio.wait_for(task, 5)
        assert resp.status_code == 499
        for _ in range(100):
            if llm.aborted:
                break
            await asyncio.sleep(0.01)
        assert llm.aborted == ["r1"] and llm.running == 0 and state.active_requests == 0

    asyncio.run(main())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_choices_finishing_at_different_times_end_once(path):
    async def body(c, llm):
        req = {"max_tokens": 10, "n": 2, "stop": "lo", "stream": True}
        req.update({"prompt": "a"} if "chat" not in path else
                   {"messages": [{"role": "user", "content": "a"}]})
        ev = events((await c.post(path, json=req)).text)
        assert ev[-1] == "[DONE]"
        by: dict[int, list] = {}
        for e in ev[:-1]:
            by.setdefault(e["choices"][0]["index"], []).append(e["choices"][0])
        for idx, chs in by.items():
            finishes = [ch["finish_reason"] for ch in chs]
            assert finishes[-1] == "stop" and finishes.count("stop") == 1, (idx, finishes)
            assert all(f is None for f in finishes[:-1])
    run(body)


def test_drain_lets_short_requests_finish_and_aborts_the_rest():
    from slipstream.cli.serve import drain

    async def body(c, llm):
        state = c._transport.app.state.serving
        short = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 5}))
        long_ = asyncio.ensure_future(c.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 200, "stream": True}))
        long2 = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 200}))
        await asyncio.sleep(0.05)
        await drain(state, 0.5)
        late = await c.post("/v1/completions", json={"prompt": "a"})
        assert late.status_code == 503 and late.headers["retry-after"]
        assert (await c.get("/health")).status_code == 503
        r = await short
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        ev = events((await long_).text)
        assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == 503
        r2 = await long2
        assert r2.status_code == 503 and "aborted" in r2.json()["error"]["message"]
        assert state.active_requests == 0 and llm.running == 0 and len(llm.aborted) == 2
    run(body, llm=FakeAsyncLLM(token_delay=0.01))


def test_null_means_default_but_max_tokens_null_means_the_context():
    async def body(c, llm):
        r = await c.post("/v1/completions", json={
            "prompt": "a" * 250, "max_tokens": None, "n": None, "stream": None, "echo": None,
            "logprobs": None, "ignore_eos": None, "min_tokens": None, "stop": None,
            "temperature": None, "skip_special_tokens": None, "unknown_field": {"x": 1}})
        d = r.json()
        assert r.status_code == 200, d
        assert len(d["choices"]) == 1 and d["usage"]["completion_tokens"] == 6  # 256 - 250
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": None,
            "n": None, "stream": None})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    run(body)


def test_return_token_ids_in_completions_and_their_absence_otherwise():
    async def body(c, llm):
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "return_token_ids": True})
        ch = r.json()["choices"][0]
        assert len(ch["token_ids"]) == 4 and all(isinstance(t, int) for t in ch["token_ids"])
        plain = (await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})).json()["choices"][0]
        assert "token_ids" not in plain  # OpenAI's shape unless asked for
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "stream": True,
                                                  "return_token_ids": True})
        chunks = events(r.text)[:-1]
        assert sum((e["choices"][0]["token_ids"] for e in chunks), []) == ch["token_ids"]
    run(body)
