"""Tool calling on /v1/chat/completions, on the fake engine: the plan's 400s, the template
shown the tools and the conversation's calls, the reply's calls parsed (whole and streamed),
"required" and named tools forced by a structural tag in the parser's markup, streamed
arguments arriving in fragments as they are written, for each parser."""
import json

import pytest

from fake_async_llm import FakeAsyncLLM, run_app
from slipstream.server.serving_tools import template_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
HERMES = dict(tool_call_parser="hermes", enable_auto_tool_choice=True)


class RecordingLLM(FakeAsyncLLM):
    """The fake engine writing `text` once, keeping each request's prompt text and params."""

    def __init__(self, text: str = CALL):
        super().__init__(max_model_len=2048, text=text)
        self.seen = []

    def validate(self, prompt, sampling_params=None):
        self.seen.append((self.tokenizer.decode(prompt), sampling_params))
        return super().validate(prompt, sampling_params)


def chat(c, text_len: int, **fields):
    return c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": text_len, **fields})


@pytest.mark.parametrize("fields,args,needle,param", [
    ({"tools": [WEATHER]}, {}, "--enable-auto-tool-choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, {"tool_call_parser": "hermes"},
     "--enable-auto-tool-choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required"}, {}, "--tool-call-parser", "tool_choice"),
    ({"tool_choice": "required"}, HERMES, "tool_choice needs tools", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, HERMES,
     "'nope', which is not among the tools", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, HERMES, "tool_choice must be", "tool_choice"),
    ({"tools": [{"type": "function"}]}, HERMES, "tools[0]", "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, HERMES, "name", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, HERMES,
     "parameters", "tools"),
    ({"functions": [WEATHER["function"]]}, HERMES, "functions is the legacy form", "functions"),
    ({"function_call": "auto"}, HERMES, "function_call is the legacy form", "function_call"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     HERMES, "cannot go with an output constraint", "tool_choice"),
])
def test_tool_requests_refused_with_400s(fields, args, needle, param):
    async def go(c, llm):
        r = await chat(c, 4, **fields)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["param"] == param, err
    run_app(go, llm=RecordingLLM(), **args)


def test_the_template_is_shown_the_tools_and_the_conversations_calls():
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

    async def go(c, llm):
        r = await c.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                        "tool_choice": "none", "max_tokens": 3})
        assert r.status_code == 200, r.text
        prompt, _ = llm.seen[-1]
        assert "<tools=[{'type': 'function', 'function': {'name': 'get_weather'" in prompt
        assert "<tool>sunny" in prompt
        bad = [dict(messages[1], tool_calls=[{"function": {"name": "f", "arguments": "{oops"}}])]
        r = await c.post("/v1/chat/completions", json={"messages": CHAT + bad + messages[2:]})
        assert r.status_code == 400 and "arguments of 'f' is not JSON" in r.text
    run_app(go, llm=RecordingLLM(), **HERMES)
    # the template gets a call's arguments as an object, as transformers' templates want
    msgs = template_messages(messages)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[1]["tool_calls"][0]["id"] == "call_1" and msgs[2] == messages[2]


def test_none_leaves_the_reply_as_text():
    async def go(c, llm):
        body = (await chat(c, len(CALL), tools=[WEATHER], tool_choice="none")).json()
        msg = body["choices"][0]["message"]
        assert msg["content"] == CALL and msg["tool_calls"] == []
        assert body["choices"][0]["finish_reason"] == "length"
    run_app(go, llm=RecordingLLM(), **HERMES)


@pytest.mark.parametrize("text,content,names", [
    (CALL, None, ["get_weather"]),
    ("It is sunny.", "It is sunny.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),  # malformed
    (TWO, None, ["get_weather", "add"]),
])
def test_auto_parses_the_calls_the_model_wrote(text, content, names):
    async def go(c, llm):
        body = (await chat(c, len(text), tools=[WEATHER, ADD])).json()
        choice = body["choices"][0]
        assert choice["message"]["content"] == content
        calls = choice["message"]["tool_calls"]
        assert [t["function"]["name"] for t in calls] == names
        for t in calls:
            assert t["id"].startswith("call_") and t["type"] == "function"
            assert isinstance(json.loads(t["function"]["arguments"]), dict)
        assert choice["finish_reason"] == ("tool_calls" if names else "length")
        assert llm.seen[-1][1].structured_outputs is None  # auto constrains nothing
    run_app(go, llm=RecordingLLM(text), **HERMES)


def test_parallel_tool_calls_false_keeps_the_first_call():
    async def go(c, llm):
        body = (await chat(c, len(TWO), tools=[WEATHER, ADD], parallel_tool_calls=False)).json()
        assert [t["function"]["name"] for t in body["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
        r = await chat(c, len(TWO), tools=[WEATHER, ADD], parallel_tool_calls=False, stream=True)
        calls = _assemble(r.text)[1]
        assert [t["name"] for t in calls] == ["get_weather"]
    run_app(go, llm=RecordingLLM(TWO), **HERMES)


def _assemble(sse: str):
    """(content, calls as {"id", "name", "arguments", "fragments"}, finish reasons) of a
    streamed reply (fragments: how many argument deltas the call came in)."""
    content, calls, finishes = "", {}, []
    for line in sse.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for t in delta.get("tool_calls", []):
                call = calls.setdefault(t["index"], {"id": None, "name": None, "arguments": "",
                                                     "fragments": 0})
                if "id" in t:
                    assert call["id"] is None  # id and name come once, first, arguments ""
                    assert t["function"]["arguments"] == ""
                    call["id"], call["name"] = t["id"], t["function"]["name"]
                else:
                    assert t["function"]["arguments"]
                    call["fragments"] += 1
                call["arguments"] += t["function"].get("arguments", "")
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    return content, [calls[i] for i in sorted(calls)], finishes


@pytest.mark.parametrize("text", [CALL, TWO, "Let me check.\n" + CALL, "No call here."])
def test_streamed_tool_call_deltas_assemble_to_the_whole_reply(text):
    async def go(c, llm):
        whole = (await chat(c, len(text), tools=[WEATHER, ADD])).json()["choices"][0]
        r = await chat(c, len(text), tools=[WEATHER, ADD], stream=True)
        content, calls, finishes = _assemble(r.text)
        assert (content or None) == whole["message"]["content"]
        assert "<tool_call>" not in content
        assert [(t["name"], t["arguments"]) for t in calls] == [
            (t["function"]["name"], t["function"]["arguments"]) for t in whole["message"]["tool_calls"]]
        assert all(t["id"].startswith("call_") for t in calls)
        assert finishes == [whole["finish_reason"]]
    run_app(go, llm=RecordingLLM(text), **HERMES)


LONG_ARGS = {"city": "Paris " * 20, "days": 14}
_LONG = json.dumps(LONG_ARGS)
_ADD_ARGS = '{"a": 1, "b": 2}'
LONG_CALLS = {  # each parser's markup of a call with a long argument, then a short one
    "hermes": CALL.replace('{"city": "Paris"}', _LONG) + "\n" + TWO.split("\n", 3)[3],
    "llama3_json": (f'<|python_tag|>{{"name": "get_weather", "parameters": {_LONG}}}; '
                    f'{{"name": "add", "parameters": {_ADD_ARGS}}}'),
    "mistral": (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {_LONG}}}, '
                f'{{"name": "add", "arguments": {_ADD_ARGS}}}]'),
    "mistral_v11": f"[TOOL_CALLS]get_weather[ARGS]{_LONG}[TOOL_CALLS]add[ARGS]{_ADD_ARGS}",
}


@pytest.mark.parametrize("case", sorted(LONG_CALLS))
def test_streamed_arguments_arrive_as_they_are_written(case):
    text, parser = LONG_CALLS[case], case.removesuffix("_v11")

    async def go(c, llm):
        whole = (await chat(c, len(text), tools=[WEATHER, ADD])).json()["choices"][0]
        assert [t["function"]["name"] for t in whole["message"]["tool_calls"]] == ["get_weather", "add"]
        r = await chat(c, len(text), tools=[WEATHER, ADD], stream=True)
        content, calls, finishes = _assemble(r.text)
        assert [(t["name"], t["arguments"]) for t in calls] == [
            (t["function"]["name"], t["function"]["arguments"]) for t in whole["message"]["tool_calls"]]
        assert json.loads(calls[0]["arguments"]) == LONG_ARGS
        assert calls[0]["fragments"] > 20  # streamed as written, not whole at the end
        assert content == "" and finishes == ["tool_calls"]
    run_app(go, llm=RecordingLLM(text), tool_call_parser=parser, enable_auto_tool_choice=True)


@pytest.mark.parametrize("choice,parallel,names", [
    ("required", True, ["get_weather", "add"]),
    ("required", False, ["get_weather", "add"]),
    ({"type": "function", "function": {"name": "add"}}, True, ["add"]),
])
def test_required_and_named_are_forced_by_a_structural_tag(choice, parallel, names):
    async def go(c, llm):
        r = await chat(c, len(CALL), tools=[WEATHER, ADD], tool_choice=choice,
                       parallel_tool_calls=parallel)
        assert r.status_code == 200, r.text
        so = llm.seen[-1][1].structured_outputs
        assert so.kind == "structural_tag"
        fmt = so.structural_tag["format"]["elements"][0]
        assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"]
        assert fmt["stop_after_first"] == (not parallel or isinstance(choice, dict))
        assert [json.loads(t["begin"][len("<tool_call>\n"):] + "0}")["name"] for t in fmt["tags"]] == names
        # the fake engine ignores the constraint; it wrote CALL, which parses
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    run_app(go, llm=RecordingLLM(), tool_call_parser="hermes")


def test_a_parser_of_special_tokens_keeps_them_in_the_text():
    async def go(c, llm):
        await chat(c, 3, tools=[WEATHER])
        assert llm.seen[-1][1].skip_special_tokens is False
    run_app(go, llm=RecordingLLM("abc"), tool_call_parser="mistral", enable_auto_tool_choice=True)


def test_bad_parser_flags_fail_at_start():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        run_app(lambda c, llm: None, tool_call_parser="nope")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        run_app(lambda c, llm: None, enable_auto_tool_choice=True)
