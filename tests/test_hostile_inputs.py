"""What a hostile client sent (issue 48), each a regression test: every value is checked at
the front door against what the engine stores it in, and a bad one is a one-line error that
names its field (a 400 over HTTP, never a 500), costing no other request anything."""
from __future__ import annotations

import json

import pytest
from fake_async_llm import run_app
from helpers import drain_core

from slipstream.cli.serve import resolve_api_key
from slipstream.core.messages import AddRequest, CoreInfo
from slipstream.frontend.llm import _as_params_list
from slipstream.frontend.prompts import (RequestRejected, normalize_messages, sampling_params_of,
                                        validate_request)
from slipstream.model.tokenizer import check_text
from slipstream.sampling.params import MAX_INT32, SamplingParams

INFO = CoreInfo(model_name="m", max_model_len=64, vocab_size=100, eos_token_ids=[2], num_kv_blocks=8,
                block_size=16, device="cpu", async_scheduling=False, max_num_batched_tokens=64)


# -- SamplingParams: integers the engine stores --------------------------------------------------
@pytest.mark.parametrize("fields, name", [
    (dict(top_k=3_000_000_000), "top_k"),
    (dict(top_k=MAX_INT32 + 1), "top_k"),
    (dict(stop_token_ids=[2 ** 70]), "stop_token_ids"),
    (dict(stop_token_ids=[1, MAX_INT32 + 1]), "stop_token_ids"),
    (dict(seed=2 ** 64), "seed"),
    (dict(seed=-(2 ** 63) - 1), "seed"),
])
def test_an_integer_the_engine_cannot_store_names_its_field(fields, name):
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    assert str(e.value).startswith(f"{name} must be") and "\n" not in str(e.value)


def test_the_integer_bounds_themselves_are_accepted():
    assert SamplingParams(top_k=MAX_INT32).top_k == MAX_INT32
    assert SamplingParams(stop_token_ids=[MAX_INT32]).stop_token_ids == [MAX_INT32]
    assert SamplingParams(seed=2 ** 64 - 1).sampler_seed == 2 ** 64 - 1
    assert SamplingParams(seed=-(2 ** 63)).seed == -(2 ** 63)


@pytest.mark.parametrize("prompt", [[1, -3], [1, -5], [2 ** 70], [2 ** 31]])
def test_token_ids_out_of_range_are_refused_at_the_front_door(prompt):
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        validate_request(prompt, None, None, INFO)


def test_params_given_as_a_dict_say_what_to_pass():
    with pytest.raises(TypeError, match=r"got a dict: pass SamplingParams\(\*\*d\)"):
        sampling_params_of({"max_tokens": 3})
    with pytest.raises(TypeError, match=r"got dict: pass SamplingParams\(\*\*d\)"):
        _as_params_list({"max_tokens": 3}, 1)


# -- text: what a tokenizer takes -----------------------------------------------------------------
def test_a_lone_surrogate_is_a_value_error_naming_the_field():
    assert check_text("prompt", "fine \u00e9") == "fine \u00e9"
    with pytest.raises(ValueError, match=r"^prompt holds a lone surrogate '\\ud800' at character 2"):
        check_text("prompt", "ab\ud800")
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content holds a lone surrogate"):
        normalize_messages([{"role": "system", "content": "x"}, {"role": "user", "content": "\udfff"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]\.text holds a lone surrogate"):
        normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "text", "text": "\ud800"}]}])


def test_a_text_part_without_text_is_named():
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.text must be a string, got nothing"):
        normalize_messages([{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.text must be a string, got int"):
        normalize_messages([{"role": "user", "content": [{"type": "text", "text": 3}]}])


# -- the core: a request it cannot store fails alone ---------------------------------------------
@pytest.mark.slow
def test_the_core_fails_a_request_it_cannot_store_alone_and_keeps_running(tokenized_tiny):
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore
    core = EngineCore(EngineConfig(model=tokenized_tiny, device="cpu", max_model_len=64, max_num_seqs=4))
    good = SamplingParams(max_tokens=3, ignore_eos=True).to_dict()
    # (past the front door: the core's own guard is what stands here)
    core.add(AddRequest("huge-top-k", [5, 6], dict(good, top_k=3_000_000_000)))
    core.add(AddRequest("negative-id", [5, -3], good))
    core.add(AddRequest("huge-id", [5, 2 ** 40], good))
    core.add(AddRequest("fine", [5, 6], good))
    ends, tokens = drain_core(core)
    assert ends["fine"] == ("length", None) and len(tokens["fine"]) == 3
    assert ends["huge-top-k"][0] == "error" and "malformed request" in ends["huge-top-k"][1]
    assert "outside the vocabulary" in ends["negative-id"][1]
    assert "outside the vocabulary" in ends["huge-id"][1]
    core.add(AddRequest("after", [7, 8], good))  # the engine is alive
    assert drain_core(core)[0]["after"] == ("length", None)


# -- the HTTP server: a 400 naming the field, and the next request answers -------------------
def _ascii_json(obj) -> dict:
    """A body whose lone surrogates travel as JSON escapes (as a hostile client sends them)."""
    return dict(content=json.dumps(obj).encode(), headers={"content-type": "application/json"})


GOOD_COMPLETION = {"prompt": "hi", "max_tokens": 2}

BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2 ** 63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2 ** 70]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, -5]}, "prompt"),
    ("/v1/completions", {"prompt": [2 ** 70]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, "min_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 70}, "seed"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS)
def test_a_bad_value_is_a_400_naming_its_field_and_the_next_request_answers(path, body, param):
    async def go(c, _):
        r = await c.post(path, **_ascii_json(body))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == 400 and "\n" not in error["message"]
        after = await c.post("/v1/completions", json=GOOD_COMPLETION)
        assert after.status_code == 200, after.text
    run_app(go)


def test_a_huge_top_k_is_clamped_to_the_vocabulary_over_http():
    async def go(c, _):
        r = await c.post("/v1/completions", json=dict(GOOD_COMPLETION, top_k=3_000_000_000))
        assert r.status_code == 200, r.text
    run_app(go)


# -- the API key -----------------------------------------------------------------------------------
def test_the_bearer_scheme_is_case_insensitive_and_the_key_must_match():
    async def go(c, _):
        for auth in ("Bearer k3y", "bearer k3y", "BEARER  k3y", "  bearer k3y "):
            r = await c.post("/v1/completions", json=GOOD_COMPLETION, headers={"authorization": auth})
            assert r.status_code == 200, auth
        for auth in ("Bearer wrong", "Basic k3y", "k3y", "Bearer", "Bearerk3y", ""):
            r = await c.post("/v1/completions", json=GOOD_COMPLETION, headers={"authorization": auth})
            assert r.status_code == 401 and r.json()["error"]["code"] == 401, auth
        assert (await c.get("/health")).status_code == 200
    run_app(go, api_key="k3y")


@pytest.mark.parametrize("key", ["", "   ", "\t"])
def test_an_empty_api_key_is_refused_at_start(key):
    with pytest.raises(ValueError, match="empty"):
        run_app(lambda c, llm: None, api_key=key)
    with pytest.raises(ValueError, match="--api-key is empty"):
        resolve_api_key(key, {})


def test_the_api_key_comes_from_the_environment():
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key("flag", {"SLIPSTREAM_API_KEY": "env"}) == "flag"
    assert resolve_api_key(None, {"SLIPSTREAM_API_KEY": "a", "VLLM_API_KEY": "b"}) == "a"
    assert resolve_api_key(None, {"VLLM_API_KEY": "b"}) == "b"
    with pytest.raises(ValueError, match="SLIPSTREAM_API_KEY is empty"):
        resolve_api_key(None, {"SLIPSTREAM_API_KEY": ""})
    with pytest.raises(ValueError, match="spaces around it"):
        resolve_api_key(" key", {})


@pytest.mark.slow
def test_llm_ends_prompts_with_ids_out_of_range_alone_and_refuses_calls_after_shutdown(tokenized_tiny):
    from slipstream import LLM
    llm = LLM(tokenized_tiny, device="cpu", max_model_len=64)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    outs = llm.generate([[1, -3], [2 ** 70], [1, 2]], params)
    assert [o.finish_reason for o in outs] == ["error", "error", "length"]
    assert "outside the vocabulary" in outs[0].error and "outside the vocabulary" in outs[1].error
    with pytest.raises(TypeError, match=r"SamplingParams\(\*\*d\)"):
        llm.generate("Hi", {"max_tokens": 3})
    llm.shutdown()
    llm.shutdown()  # a second call does nothing
    with pytest.raises(RuntimeError, match="was shut down"):
        llm.generate([[1, 2]], params)


# -- serve flags: refused before anything loads ---------------------------------------------------
@pytest.mark.parametrize("flags, words", [
    (["--port", "99999"], "--port must be in [0, 65535], got 99999"),
    (["--port", "-1"], "--port must be in [0, 65535]"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a finite number >= 0, got nan"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout must be a finite number"),
    (["--core-restart-backoff", "nan"], "--core-restart-backoff must be a finite number"),
    (["--max-core-restarts", "-1"], "--max-core-restarts must be >= 0"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
])
def test_bad_serve_flags_are_refused_before_the_model_loads(flags, words, capsys, monkeypatch):
    from slipstream.cli import serve
    from slipstream.cli.main import main
    monkeypatch.setattr(serve, "make_llm", lambda a: pytest.fail("the model was loaded"))
    assert main(["serve", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_an_empty_api_key_in_the_environment_is_refused(capsys, monkeypatch):
    from slipstream.cli import serve
    from slipstream.cli.main import main
    monkeypatch.setattr(serve, "make_llm", lambda a: pytest.fail("the model was loaded"))
    monkeypatch.setenv("SLIPSTREAM_API_KEY", "")
    assert main(["serve", "--device", "cpu"]) == 2
    assert "SLIPSTREAM_API_KEY is empty" in capsys.readouterr().err


def test_ctrl_c_while_the_model_loads_exits_cleanly(capsys, monkeypatch):
    from slipstream.cli import engine_setup
    from slipstream.cli.main import main

    def interrupted(kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_setup, "load_llm", interrupted)
    assert main(["generate", "--device", "cpu", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
