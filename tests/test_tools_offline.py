"""Tools offline: LLM.chat(tools=...) and JSONL batch rows with `tools` show the tools to the
chat template; the reply's calls are read with the server's parsers."""
import json
import os

import pytest

from fake_async_llm import FakeTokenizer
from slipstream.frontend.batch_rows import RowDefaults, parse_row
from slipstream.server.tool_parsers import get_tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TEMPLATE = os.path.join(os.path.dirname(__file__), "data", "hermes_tool_template.jinja")


def test_a_batch_row_with_tools_renders_them():
    row = parse_row({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}, RowDefaults())
    assert row.chat.tools == [WEATHER]
    tok = FakeTokenizer()
    assert "<tools=[{'type': 'function'" in tok.decode(row.engine_prompt(tok))
    assert parse_row({"messages": [{"role": "user", "content": "hi"}]}, RowDefaults()).chat.tools is None
    with pytest.raises(ValueError, match="tools must be a list"):
        parse_row({"messages": [{"role": "user", "content": "hi"}], "tools": "get_weather"}, RowDefaults())
    with pytest.raises(ValueError, match="apply to chats only"):
        parse_row({"prompt": "hi", "tools": [WEATHER]}, RowDefaults())


@pytest.mark.slow
def test_llm_chat_shows_the_tools_and_the_reply_parses():
    from slipstream import LLM
    from slipstream.sampling.params import SamplingParams

    with LLM(device="cpu", max_model_len=1024) as llm:
        template = open(TEMPLATE).read()
        (out,) = llm.chat([{"role": "user", "content": "What is the weather in Paris?"}],
                          SamplingParams(max_tokens=40, temperature=0.0), tools=[WEATHER],
                          chat_template=template)
        prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt
        got = get_tool_parser("hermes").extract(out.outputs[0].text)
        for call in got.tool_calls:  # whatever the model wrote, it reads as content or calls
            assert isinstance(json.loads(call.arguments), dict)
        assert got.tool_calls or got.content
