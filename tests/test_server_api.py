"""`slipstream serve` on the CPU with the embedded SmolLM2, one server for the module: the
openai client (sync, async, streaming), greedy streamed == non-streamed, n and several
prompts, logprobs, echo + logprobs against the offline engine's prompt logprobs, the
tokenizer endpoints, 32 concurrent streams with some closed early (the rest complete, the
KV blocks come back, the counters add up), and a table of hostile requests."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from server_utils import ServerProcess, metric

pytestmark = pytest.mark.subprocess  # one `slipstream serve` process for the module

MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = ServerProcess("--max-body-bytes", str(MAX_BODY), "--served-model-name", "smol",
                        "other-name", log_path=str(log))
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["smol", "other-name"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.head(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]
    info = httpx.get(server.url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] > 0


def test_completion_streamed_equals_non_streamed(client):
    kw = dict(model="smol", prompt="The capital of France is", max_tokens=6, temperature=0)
    full = client.completions.create(**kw)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.usage.completion_tokens == 6 and full.choices[0].finish_reason == "length"
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == full.choices[0].text
    assert "Paris" in full.choices[0].text


def test_chat_streamed_equals_non_streamed(client):
    kw = dict(model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
              max_tokens=6, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.id.startswith("chatcmpl-") and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **kw))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == full.choices[0].finish_reason


def test_n_and_several_prompts(client):
    r = client.completions.create(model="smol", prompt=["Once upon a", "My favourite"], n=2,
                                  max_tokens=2, temperature=0.8, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 8


def test_logprobs(client):
    r = client.completions.create(model="smol", prompt="1, 2, 3,", max_tokens=3, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 2 <= len(top) <= 3 and top[tok] == val
        assert val == max(top.values())  # greedy
    c = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob == t.top_logprobs[0].logprob for t in content)


def test_echo_logprobs_match_offline_prompt_logprobs(client):
    from slipstream import LLM, SamplingParams
    from slipstream.model.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    prompts = ["The capital of France is Paris", "Water boils at 100 degrees"]
    ids = [tok.encode(p) for p in prompts]
    r = client.completions.create(model="smol", prompt=ids, max_tokens=1, logprobs=1, echo=True,
                                  temperature=0)
    z = client.completions.create(model="smol", prompt=prompts[0], max_tokens=0, logprobs=1,
                                  echo=True, temperature=0)
    assert z.usage.completion_tokens == 0 and z.choices[0].text == prompts[0]
    llm = LLM(device="cpu")
    outs = llm.generate(ids, SamplingParams(prompt_logprobs=1, max_tokens=1, temperature=0))
    for choice, out, p_ids in zip(sorted(r.choices, key=lambda c: c.index), outs, ids):
        lp = choice.logprobs
        n = len(p_ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        offline = [None] + [out.prompt_logprobs[i][t] for i, t in enumerate(p_ids) if i > 0]
        assert lp.token_logprobs[:n] == pytest.approx(offline, abs=2e-3)
        assert len(lp.tokens) == n + 1 and choice.text.startswith(tok.decode(p_ids))
    assert z.choices[0].logprobs.token_logprobs == pytest.approx(
        r.choices[0].logprobs.token_logprobs[:len(ids[0])], abs=2e-3)


def test_tokenize_matches_the_tokenizer(server):
    from slipstream.model.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    text = "Hello, wörld! 你好 <|im_start|>"
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=10).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    msgs = [{"role": "user", "content": "Hi"}]
    r2 = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=10).json()
    assert r2["tokens"] == tok.apply_chat_template(msgs)
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert back["prompt"] == tok.decode(r["tokens"], skip_special_tokens=False)


def test_continue_final_message_through_the_openai_client(server, client):
    from slipstream.model.tokenizer import ChatOptions, load_tokenizer

    tok = load_tokenizer(None)
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True,
             "chat_template_kwargs": {"unused_variable": 1}}
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=4, temperature=0,
                                       extra_body=extra)
    want = tok.apply_chat_template(msgs, ChatOptions(False, True))
    assert tok.decode(want, skip_special_tokens=False).endswith("assistant\nMy favourite colour is")
    assert r.usage.prompt_tokens == len(want) and r.usage.completion_tokens == 4
    t = httpx.post(server.url + "/tokenize", json={"messages": msgs, **extra}, timeout=10).json()
    assert t["tokens"] == want
    echoed = client.chat.completions.create(model="smol", messages=msgs, max_tokens=4, temperature=0,
                                            extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == msgs[1]["content"] + r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt to be false"):
        client.chat.completions.create(model="smol", messages=msgs, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_include_stop_str_in_output(client):
    free = client.completions.create(model="smol", prompt="The sky is", max_tokens=12, temperature=0)
    text = free.choices[0].text
    stop = text[4:7]
    assert len(stop) == 3 and stop in text
    cut = text.index(stop)
    plain, kept = (client.completions.create(model="smol", prompt="The sky is", max_tokens=12, temperature=0,
                                             stop=[stop], extra_body={"include_stop_str_in_output": inc})
                   for inc in (False, True))
    assert plain.choices[0].text == text[:cut] and kept.choices[0].text == text[:cut + len(stop)]
    assert plain.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    chat = dict(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
    said = client.chat.completions.create(**chat).choices[0].message.content
    stop = said[2:5]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        **chat, stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True}) if ch.choices)
    assert streamed == said[:said.index(stop) + len(stop)]


def test_truncation_special_tokens_and_refused_extras(server, client):
    prompt = "One two three four five six seven eight nine ten"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=60).json()["tokens"]
    greedy = dict(model="smol", max_tokens=4, temperature=0)
    cut = client.completions.create(prompt=prompt, echo=True, extra_body={"truncate_prompt_tokens": 3}, **greedy)
    alone = client.completions.create(prompt=ids[-3:], echo=True, **greedy)
    assert cut.usage.prompt_tokens == 3 < len(ids)
    assert cut.choices[0].text == alone.choices[0].text  # the last 3 tokens, echoed, then the same reply
    # SmolLM2 adds no BOS to a plain prompt: add_special_tokens changes nothing there, and a chat
    # prompt gets no second set of special tokens from the tokenizer by default
    plain = client.completions.create(prompt=prompt, extra_body={"add_special_tokens": False}, **greedy)
    assert plain.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="use_beam_search is not supported"):
        client.completions.create(prompt=prompt, extra_body={"use_beam_search": True}, **greedy)
    with pytest.raises(openai.BadRequestError, match="guided_choice: choice must be"):
        client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"guided_choice": []}, **greedy)


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    # ~880 KB of text is ~200K tokens: tokenizing it takes a good fraction of a second, and
    # the server goes on answering meanwhile (on the event loop it would answer nothing)
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 14000
    done: dict = {}

    def send():
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": text, "max_tokens": 1},
                       timeout=120)
        done.update(status=r.status_code, error=r.json()["error"]["message"], s=time.monotonic() - t0)

    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    while sender.is_alive() and len(waits) < 2000:
        t0 = time.monotonic()
        assert httpx.get(server.url + "/v1/models", timeout=60).status_code == 200
        waits.append(time.monotonic() - t0)
    sender.join(120)
    assert done["status"] == 400 and "maximum context length" in done["error"]  # after tokenizing
    assert done["s"] > 0.2  # long enough for the polls to mean something
    assert max(waits) < done["s"] / 2 and len(waits) >= 3, (max(waits), len(waits), done["s"])


def test_async_client_and_concurrent_streams_with_disconnects(server):
    before = httpx.get(server.url + "/metrics", timeout=10).text

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                    timeout=180)
        prompt = "Tell me a story about a dragon"

        async def complete_one():
            stream = await client.completions.create(model="smol", prompt=prompt, max_tokens=4,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            text, finish = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        async def close_early(http):
            body = {"model": "smol", "prompt": prompt, "max_tokens": 200, "stream": True,
                    "ignore_eos": True}
            async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n += 1
                        if n == 2:
                            break
            return n

        async with httpx.AsyncClient(timeout=180) as http:
            results = await asyncio.gather(*(complete_one() for _ in range(24)),
                                           *(close_early(http) for _ in range(8)))
        await client.close()
        return results

    results = asyncio.run(asyncio.wait_for(main(), 240))
    done, closed = results[:24], results[24:]
    assert all(f == "length" for _, f in done) and len({t for t, _ in done}) == 1
    assert closed == [2] * 8
    page = ""
    for _ in range(100):  # the aborted requests leave the engine
        page = httpx.get(server.url + "/metrics", timeout=10).text
        if (metric(page, "slipstream:num_requests_running") == 0
                and metric(page, "slipstream:kv_blocks_in_use") == 0
                and metric(page, "slipstream:request_success_total", finished_reason="abort")
                - metric(before, "slipstream:request_success_total", finished_reason="abort") == 8):
            break
        time.sleep(0.2)
    assert metric(page, "slipstream:num_requests_running") == 0
    assert metric(page, "slipstream:kv_blocks_in_use") == 0
    assert metric(page, "slipstream:kv_cache_usage_perc") == 0

    def delta(name, **labels):
        return metric(page, name, **labels) - metric(before, name, **labels)

    assert delta("slipstream:request_success_total", finished_reason="length") == 24
    assert delta("slipstream:request_success_total", finished_reason="abort") == 8
    gen = delta("slipstream:generation_tokens_total")
    assert 24 * 4 + 8 <= gen < 24 * 4 + 8 * 200
    assert delta("slipstream:prompt_tokens_total") % 32 == 0
    assert delta("slipstream:e2e_request_latency_seconds_count") == 32


def test_non_streaming_client_gone_aborts(server):
    """A raw socket sends a long non-streaming request, waits until it runs, and hangs up."""
    import socket
    from urllib.parse import urlparse

    before = httpx.get(server.url + "/metrics", timeout=10).text
    body = json.dumps({"prompt": "Write a long essay", "max_tokens": 2000, "ignore_eos": True})
    u = urlparse(server.url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                  + body).encode())
    running = 0.0
    for _ in range(300):
        running = metric(httpx.get(server.url + "/metrics", timeout=30).text,
                         "slipstream:num_requests_running")
        if running:
            break
        time.sleep(0.1)
    sock.close()
    assert running == 1
    page, aborted = "", 0.0
    for _ in range(300):
        page = httpx.get(server.url + "/metrics", timeout=30).text
        aborted = (metric(page, "slipstream:request_success_total", finished_reason="abort")
                   - metric(before, "slipstream:request_success_total", finished_reason="abort"))
        if aborted == 1 and metric(page, "slipstream:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert aborted == 1 and metric(page, "slipstream:num_requests_running") == 0
    assert metric(page, "slipstream:kv_blocks_in_use") == 0


B = "/v1/completions"
C = "/v1/chat/completions"
U = [{"role": "user", "content": "hi"}]
HOSTILE = [
    ("POST", B, b"{not json", 400), ("POST", B, b'{"prompt": "\xff\xfe"}', 400),
    ("POST", B, b"[]", 400), ("POST", B, b"", 400), ("POST", B, b"null", 400),
    ("POST", B, b'{"prompt": "a", "temperature": NaN}', 400),
    ("POST", B, b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400),
    ("POST", B, b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}', 413),
    ("POST", B, {"prompt": 5}, 400), ("POST", B, {"prompt": None}, 400), ("POST", B, {}, 400),
    ("POST", B, {"prompt": ""}, 400), ("POST", B, {"prompt": []}, 400),
    ("POST", B, {"prompt": [[]]}, 400), ("POST", B, {"prompt": [1, "a"]}, 400),
    ("POST", B, {"prompt": [-1]}, 400), ("POST", B, {"prompt": [10 ** 6]}, 400),
    ("POST", B, {"prompt": [2 ** 70]}, 400), ("POST", B, {"prompt": [1.5]}, 400),
    ("POST", B, {"prompt": [True]}, 400), ("POST", B, {"prompt": [7] * 9000}, 400),
    ("POST", B, {"prompt": "hello " * 9000}, 400),
    ("POST", B, {"prompt": "a", "max_tokens": -1}, 400),
    ("POST", B, {"prompt": "a", "max_tokens": "ten"}, 400),
    ("POST", B, {"prompt": "a", "max_tokens": 10 ** 12}, 400),
    ("POST", B, {"prompt": "a", "temperature": -1}, 400),
    ("POST", B, {"prompt": "a", "temperature": "hot"}, 400),
    ("POST", B, {"prompt": "a", "top_p": 0}, 400), ("POST", B, {"prompt": "a", "top_p": 1.5}, 400),
    ("POST", B, {"prompt": "a", "top_k": -5}, 400), ("POST", B, {"prompt": "a", "min_p": 2}, 400),
    ("POST", B, {"prompt": "a", "n": 0}, 400), ("POST", B, {"prompt": "a", "n": 10 ** 9}, 400),
    ("POST", B, {"prompt": "a", "logprobs": 21}, 400), ("POST", B, {"prompt": "a", "logprobs": -1}, 400),
    ("POST", B, {"prompt": "a", "presence_penalty": 5}, 400),
    ("POST", B, {"prompt": "a", "frequency_penalty": -3}, 400),
    ("POST", B, {"prompt": "a", "repetition_penalty": 0}, 400),
    ("POST", B, {"prompt": "a", "stop": [1, 2]}, 400), ("POST", B, {"prompt": "a", "stop": [""]}, 400),
    ("POST", B, {"prompt": "a", "stop_token_ids": [-1]}, 400),
    ("POST", B, {"prompt": "a", "stop_token_ids": [10 ** 9]}, 400),
    ("POST", B, {"prompt": "a", "max_tokens": 5, "min_tokens": 100}, 400),
    ("POST", B, {"prompt": "a", "stream_options": {"include_usage": True}}, 400),
    ("POST", B, {"prompt": "a", "seed": "abc"}, 400), ("POST", B, {"prompt": "a", "echo": "maybe"}, 400),
    ("POST", B, {"prompt": "a", "suffix": "x"}, 400),
    ("POST", B, {"prompt": "a", "logit_bias": {"1": 5}}, 400),
    ("POST", B, {"prompt": "a", "model": "nope"}, 404),
    ("POST", C, {"messages": []}, 400), ("POST", C, {"messages": "hi"}, 400),
    ("POST", C, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("POST", C, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("POST", C, {"messages": [{"role": "user", "content": None}]}, 400),
    ("POST", C, {"messages": [{"content": "x"}]}, 400),
    ("POST", C, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400),
    ("POST", C, {"messages": U, "top_logprobs": 2}, 400),
    ("POST", C, {"messages": U, "logprobs": True, "top_logprobs": 30}, 400),
    ("POST", C, {"messages": U, "response_format": {"type": "json_schema"}}, 400),
    ("POST", C, {"messages": U, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("POST", C, {"messages": U, "max_completion_tokens": 0}, 400),
    ("POST", C, {"messages": U, "stream_options": {"include_usage": True}}, 400),
    ("POST", C, {"messages": U, "model": "nope"}, 404),
    ("GET", B, None, 405), ("POST", "/v1/models", {}, 405), ("GET", "/nope", None, 404),
    ("POST", "/v1/nope", {}, 404), ("GET", "/v1/models/nope", None, 404),
    ("POST", "/tokenize", {}, 400), ("POST", "/tokenize", {"prompt": 5}, 400),
    ("POST", "/detokenize", {"tokens": [-5]}, 400), ("POST", "/detokenize", {"tokens": "abc"}, 400),
]


def test_hostile_requests_then_still_serving(server, client):
    assert len(HOSTILE) >= 40
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path, body, status in HOSTILE:
            if isinstance(body, bytes):
                r = http.request(method, path, content=body,
                                 headers={"Content-Type": "application/json"})
            else:
                r = http.request(method, path, json=body)
            what = f"{method} {path} {str(body)[:80]!r}"
            assert r.status_code == status, (what, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, what
            assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="smol", prompt="hi " * 9000, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=2,
                                  temperature=0)
    assert r.choices[0].text.strip() and httpx.get(server.url + "/health").status_code == 200


def test_engine_death_is_503_never_500(server):
    """Last in the module: the engine core is killed under a running stream."""
    import os
    import signal

    from server_utils import child_pids

    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                for pid in child_pids(server.proc.pid):
                    os.kill(pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and "dead" in err["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
