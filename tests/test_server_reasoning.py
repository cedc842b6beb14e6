"""--reasoning-parser in chat on the fake engine: the thinking in reasoning_content and
reasoning, the answer in content, streamed deltas of the same names adding up to the whole
reply (at several stream intervals), an unterminated think, no think block, replies
without a parser, and usage.completion_tokens_details.reasoning_tokens counting the
thinking's tokens."""
from __future__ import annotations

import json

import pytest

from fake_async_llm import FakeAsyncLLM, run_app

THOUGHT = "<think>Add 2 and 2.</think>It is 4."
MESSAGES = [{"role": "user", "content": "2+2?"}]


def _chat(text, max_tokens, parser="qwen3", stream=False, interval=1, **extra):
    async def body(c, llm):
        r = await c.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream, **extra})
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()
        return [json.loads(line[6:]) for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    return run_app(body, FakeAsyncLLM(text=text), reasoning_parser=parser, stream_interval=interval)


def test_the_thinking_and_the_answer_are_apart():
    msg = _chat(THOUGHT, len(THOUGHT))["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "Add 2 and 2."
    assert msg["content"] == "It is 4."


@pytest.mark.parametrize("interval", [1, 2, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_reply(interval):
    chunks = _chat(THOUGHT, len(THOUGHT), stream=True, interval=interval)
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning", "") for d in deltas) == "Add 2 and 2."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    assert not any("<think>" in json.dumps(d) or "</think>" in json.dumps(d) for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_inside_the_thinking():
    msg = _chat(THOUGHT, 12)["choices"][0]["message"]
    assert msg["reasoning_content"] == "Add 2" and msg["content"] is None
    deltas = [ch["choices"][0]["delta"] for ch in _chat(THOUGHT, 12, stream=True)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Add 2"
    assert not any(d.get("content") for d in deltas)


def test_a_reply_without_a_think_block_is_all_answer():
    # as Qwen3 replies with chat_template_kwargs {"enable_thinking": false}
    answer = "It is 4. "
    msg = _chat(answer, len(answer), chat_template_kwargs={"enable_thinking": False})
    msg = msg["choices"][0]["message"]
    assert msg["content"] == answer and msg["reasoning_content"] is None


def test_deepseek_r1_starts_inside_the_thinking():
    text = "Add 2 and 2.</think>It is 4."
    msg = _chat(text, len(text), parser="deepseek_r1")["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Add 2 and 2.", "It is 4.")


def test_without_a_parser_the_tags_stay_in_the_content():
    msg = _chat(THOUGHT, len(THOUGHT), parser=None)["choices"][0]["message"]
    assert msg["content"] == THOUGHT and msg["reasoning_content"] is None


def test_an_unknown_parser_is_refused_at_startup():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        _chat(THOUGHT, 4, parser="nope")


def test_the_cli_flag():
    import argparse

    from slipstream.cli.serve import add_serve_parser
    sub = argparse.ArgumentParser().add_subparsers()
    p = add_serve_parser(sub, lambda p: None)
    assert p.parse_args(["--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "nope"])


def test_a_structured_output_is_constrained_after_the_thinking():
    from slipstream.sampling.params import SamplingParams
    from slipstream.server.reasoning_parsers import get_reasoning_parser
    from slipstream.server.serving_reasoning import constrain_after_reasoning
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert constrain_after_reasoning(None, params) is params
    assert constrain_after_reasoning(get_reasoning_parser("qwen3"), SamplingParams()).structured_outputs is None
    tag = constrain_after_reasoning(get_reasoning_parser("deepseek_r1"), params).structured_outputs
    first, _, answer = tag.structural_tag["format"]["elements"]
    assert first == {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
    assert answer == {"type": "json_schema", "json_schema": {"type": "object"}}


def test_run_batch_chat_lines_are_split_too():
    import asyncio

    from slipstream.server.reasoning_parsers import get_reasoning_parser
    from slipstream.server.run_batch import run_batch
    from slipstream.server.serving_common import ServingState

    async def main():
        state = ServingState(llm=FakeAsyncLLM(text=THOUGHT), served_names=["fake-model"],
                             reasoning_parser=get_reasoning_parser("qwen3"))
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": MESSAGES, "max_tokens": len(THOUGHT)}})
        rows = []
        await run_batch(state, [line], rows.append, 4)
        state.close()
        return rows

    (row,) = asyncio.run(main())
    msg = row["response"]["body"]["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Add 2 and 2.", "It is 4.")


# the fake engine's tokens are bytes: the thinking, tags included, is this many tokens
THINKING = len("<think>Add 2 and 2.</think>")


@pytest.mark.parametrize("parser,text,max_tokens,expected", [
    ("qwen3", THOUGHT, len(THOUGHT), THINKING),
    ("qwen3", THOUGHT, 12, 12),  # max_tokens inside the thinking: all of it
    ("qwen3", "It is 4. ", 9, 0),  # no think block
    ("deepseek_r1", "Add 2 and 2.</think>It is 4.", 28, len("Add 2 and 2.</think>")),
])
def test_reasoning_tokens_count_the_thinking(parser, text, max_tokens, expected):
    usage = _chat(text, max_tokens, parser=parser)["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}
    assert usage["completion_tokens"] == max_tokens
    chunks = _chat(text, max_tokens, parser=parser, stream=True, interval=5,
                   stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}


def test_reasoning_tokens_add_up_over_choices_and_are_absent_without_a_parser():
    # the fake engine's second choice starts one character later: "think>..." does not think
    usage = _chat(THOUGHT, len(THOUGHT), n=2)["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": THINKING}
    assert "completion_tokens_details" not in _chat(THOUGHT, len(THOUGHT), parser=None)["usage"]


def test_reasoning_tokens_follow_the_decoded_text_of_multibyte_tokens():
    from fake_async_llm import FakeTokenizer
    from slipstream.server.reasoning_parsers import get_reasoning_parser
    from slipstream.server.serving_reasoning import reasoning_tokens

    tok, qwen3 = FakeTokenizer(), get_reasoning_parser("qwen3")
    thought = "<think>é 😀</think>ok"
    ids = tok.encode(thought, add_special_tokens=False)
    assert len(ids) > len(thought)  # é and 😀 are several byte tokens
    assert reasoning_tokens(qwen3, tok, ids, thought) == len("<think>é 😀</think>".encode())
    assert reasoning_tokens(None, tok, ids, thought) == 0
    assert reasoning_tokens(qwen3, tok, [], "") == 0


@pytest.mark.parametrize("thinking,answer", [(1, 1), (3, 500), (500, 3), (257, 256), (64, 0)])
def test_reasoning_tokens_from_either_side(thinking, answer):
    # searched from the shorter side (the answer's tokens when the thinking is long), the
    # count is the same: every thinking length against every answer length
    from fake_async_llm import FakeTokenizer
    from slipstream.server.reasoning_parsers import get_reasoning_parser
    from slipstream.server.serving_reasoning import reasoning_tokens

    tok, qwen3 = FakeTokenizer(), get_reasoning_parser("qwen3")
    text = "<think>" + "t" * thinking + "</think>" + "a" * answer
    ids = tok.encode(text, add_special_tokens=False) + [2]  # and EOS, decoded to nothing
    expected = len("<think></think>") + thinking if answer else len(ids)  # no answer: all
    assert reasoning_tokens(qwen3, tok, ids, text) == expected


@pytest.mark.parametrize("answer", ["4.", " The answer is 4, é 😀 " * 40])
def test_reasoning_tokens_with_a_real_tokenizer(answer):
    # SmolLM2's byte-level BPE: the count is the fewest leading tokens whose text reaches
    # past the closing tag, found by brute force here, whichever side is searched
    from slipstream.model.tokenizer import load_tokenizer
    from slipstream.server.reasoning_parsers import get_reasoning_parser
    from slipstream.server.serving_reasoning import reasoning_tokens

    tok, qwen3 = load_tokenizer(None), get_reasoning_parser("qwen3")
    text = "<think>Adding: 2 + 2, café 😀 " * 20 + "</think>" + answer
    ids = tok.encode(text, add_special_tokens=False)
    decoded = tok.decode(ids)
    end = decoded.index("</think>") + len("</think>")
    brute = next(k for k in range(len(ids) + 1) if len(tok.decode(ids[:k])) >= end)
    assert reasoning_tokens(qwen3, tok, ids, decoded) == brute
