"""/v1/responses with function tools and text.format on the fake engine, through the
official openai client: a function call item and the tool loop continued by
previous_response_id, a streamed call's argument events, a named tool_choice forced,
text.format json_schema as the structured output, and after the thinking with a reasoning
parser."""
from __future__ import annotations

import json

import openai

from fake_async_llm import FakeAsyncLLM, run_app

MODEL = "fake-model"

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES = dict(tool_call_parser="hermes", enable_auto_tool_choice=True)


class RecordingLLM(FakeAsyncLLM):
    """The fake engine keeping each request's prompt text and sampling params."""

    def __init__(self, text: str):
        super().__init__(text=text, max_model_len=1024)
        self.seen = []

    def validate(self, prompt, sampling_params=None):
        self.seen.append((self.tokenizer.decode(prompt), sampling_params))
        return super().validate(prompt, sampling_params)


def _recording(fn, text, **args):
    async def body(http, llm):
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http,
                                    max_retries=0)
        return await fn(client, llm, http)
    return run_app(body, RecordingLLM(text), **args)


def test_a_function_call_and_the_tool_loop():
    async def fn(client, llm, http):
        r = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                          max_output_tokens=len(CALL))
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
        assert "get_weather" in llm.seen[0][0]  # the template was shown the tool
        # the client runs the tool and sends its output back, continuing the stored response
        await client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER],
                                      max_output_tokens=3, input=[{
                                          "type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny, 21 C"}])
        # the fake template writes each turn's content: the user's, the assistant's call
        # turn (no text), the tool's output
        assert llm.seen[1][0].endswith("<user>Weather in Paris?\n<assistant>\n<tool>sunny, 21 C\n"
                                       "<assistant>")
    _recording(fn, CALL, **HERMES)


def test_a_streamed_function_call():
    async def fn(client, llm, http):
        kinds, args, fragments = [], "", 0
        async with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER],
                                           max_output_tokens=len(CALL)) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.function_call_arguments.delta":
                    args += event.delta
                    fragments += 1
            final = await stream.get_final_response()
        assert fragments > 3  # the arguments stream as the model writes them
        assert kinds[2] == "response.output_item.added"
        assert kinds[-3:] == ["response.function_call_arguments.done",
                              "response.output_item.done", "response.completed"]
        (call,) = final.output
        assert call.type == "function_call" and json.loads(args) == json.loads(call.arguments) == {
            "city": "Paris"}
    _recording(fn, CALL, **HERMES)


def test_a_named_tool_choice_is_forced():
    async def fn(client, llm, http):
        await client.responses.create(model=MODEL, input="x", tools=[WEATHER], max_output_tokens=3,
                                      tool_choice={"type": "function", "name": "get_weather"})
        assert llm.seen[0][1].structured_outputs is not None  # the call's grammar
    _recording(fn, CALL, **HERMES)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_text_format_json_schema_is_the_structured_output():
    async def fn(client, llm, http):
        r = await client.responses.create(model=MODEL, input="x", max_output_tokens=8, text={
            "format": {"type": "json_schema", "name": "A", "schema": SCHEMA, "strict": True}})
        assert r.output_text == '{"a": 3}' and json.loads(r.output_text) == {"a": 3}
        assert r.text.format.type == "json_schema"
        so = llm.seen[0][1].structured_outputs
        assert so.kind == "json" and json.loads(so.key().spec) == SCHEMA
    _recording(fn, '{"a": 3}')


def test_text_format_after_the_thinking_with_a_reasoning_parser():
    async def fn(client, llm, http):
        r = await client.responses.create(model=MODEL, input="x", max_output_tokens=len(text),
                                          text={"format": {"type": "json_schema", "name": "A",
                                                           "schema": SCHEMA}})
        assert [i.type for i in r.output] == ["reasoning", "message"]
        assert json.loads(r.output_text) == {"a": 3}
        so = llm.seen[0][1].structured_outputs
        elements = so.structural_tag["format"]["elements"]
        assert elements[0]["content"]["begin"] == "<think>"
        assert elements[-1] == {"type": "json_schema", "json_schema": SCHEMA}
    text = '<think>{"a": "?"}</think>{"a": 3}'
    _recording(fn, text, reasoning_parser="qwen3")

