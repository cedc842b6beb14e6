"""vLLM's request extras on the fake engine: truncate_prompt_tokens, add_special_tokens, and
the extras slipstream does not have, which are refused (400 naming the field) rather than
ignored. (include_stop_str_in_output runs against the real server: test_server_api.py.)"""
from __future__ import annotations

import pytest

from fake_async_llm import FakeAsyncLLM, run_app
from slipstream.server.protocol import UNSUPPORTED

CHAT = [{"role": "user", "content": "abcdef"}]


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    async def body(c, llm):
        r = await c.post("/v1/completions", json={"prompt": [10, 11, 12, 13, 14], "max_tokens": 2,
                                                  "truncate_prompt_tokens": 3, "echo": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 3
        assert r.json()["choices"][0]["text"].startswith(llm.tokenizer.decode([12, 13, 14]))
        r = await c.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 2, "echo": True,
                                                  "truncate_prompt_tokens": 2})
        assert r.json()["usage"]["prompt_tokens"] == 2 and r.json()["choices"][0]["text"].startswith("ef")
        whole = (await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})).json()
        cut = (await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                          "truncate_prompt_tokens": 4})).json()
        assert cut["usage"]["prompt_tokens"] == 4 < whole["usage"]["prompt_tokens"]
        r = await c.post("/v1/completions", json={"prompt": "x" * 300, "max_tokens": 2,
                                                  "truncate_prompt_tokens": -1})
        assert r.status_code == 400 and "maximum context length is 256" in r.text  # 256 + 2 > 256
        r = await c.post("/v1/completions", json={"prompt": "x" * 300, "max_tokens": 2,
                                                  "truncate_prompt_tokens": 200})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 200
        r = await c.post("/v1/completions", json={"prompt": "abc", "truncate_prompt_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    run_app(body, max_body_bytes=1 << 16)


def test_add_special_tokens():
    llm = FakeAsyncLLM()
    llm.tokenizer.hf.adds_bos = True

    async def body(c, llm):
        async def prompt_tokens(path, **kw):
            r = await c.post(path, json={"max_tokens": 1, **kw})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]
        assert await prompt_tokens("/v1/completions", prompt="abc") == 4  # BOS + 3
        assert await prompt_tokens("/v1/completions", prompt="abc", add_special_tokens=False) == 3
        plain = await prompt_tokens("/v1/chat/completions", messages=CHAT)
        assert await prompt_tokens("/v1/chat/completions", messages=CHAT, add_special_tokens=True) == plain + 1
        tokens = (await c.post("/tokenize", json={"messages": CHAT})).json()["tokens"]
        assert len(tokens) == plain and tokens[0] != 1
        assert (await c.post("/tokenize", json={"prompt": "abc"})).json()["tokens"][0] == 1
    run_app(body, llm=llm)


@pytest.mark.parametrize("name, value", [
    ("use_beam_search", True), ("length_penalty", 0.5), ("allowed_token_ids", [5]),
    ("bad_words", ["no"]), ("priority", 1), ("prompt_logprobs", 1),
    ("return_tokens_as_token_ids", True),
])
def test_unsupported_extras_are_refused_by_name(name, value):
    assert name in UNSUPPORTED

    async def body(c, llm):
        for path, req in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": CHAT})):
            r = await c.post(path, json={**req, "max_tokens": 1, name: value})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == name and f"{name} is not supported" in err["message"]
            r = await c.post(path, json={**req, "max_tokens": 1, name: UNSUPPORTED[name]})
            assert r.status_code == 200, (path, r.text)  # the value that means "not used" is fine
    run_app(body)


def test_empty_lists_mean_not_used():
    async def body(c, llm):
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "bad_words": [],
                                                  "allowed_token_ids": [], "priority": 0})
        assert r.status_code == 200, r.text
    run_app(body)
