"""POST /v1/responses on the fake engine, driven by the official openai client: text from a
string or message items, instructions, the stream's events in order with the text
assembled, usage, incomplete at max_output_tokens, reasoning items, previous_response_id
and the LRU store (404 for an unknown or evicted id; DELETE), the function-call tool loop as chat
messages, text.format, and the 400s for what this server does not have."""
from __future__ import annotations

import json

import openai
import pytest

from fake_async_llm import FakeAsyncLLM, run_app
from slipstream.core.messages import CoreOutput

TEXT = "Hello world! The sky is blue. "
MODEL = "fake-model"


class EndingFakeLLM(FakeAsyncLLM):
    """The fake engine whose reply ends (EOS, finish_reason stop) where its text has a '|'."""

    def _core_output(self, c, params, step, prompt_logprobs):
        if self.text[(step + c.index) % len(self.text)] == "|":
            return CoreOutput(c.core_id, [2], finish_reason="stop")
        return super()._core_output(c, params, step, prompt_logprobs)


def _with_client(fn, text=TEXT, **args):
    """fn(client, llm, http) against a fresh app on the fake engine (AsyncOpenAI over ASGI)."""
    async def body(http, llm):
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http,
                                    max_retries=0)
        return await fn(client, llm, http)
    llm = EndingFakeLLM(text=text) if "|" in text else FakeAsyncLLM(text=text)
    return run_app(body, llm, **args)


async def _prompt_len(http, messages) -> int:
    """The prompt's token count as the server renders `messages` (its /tokenize)."""
    r = await http.post("/tokenize", json={"messages": messages})
    return r.json()["count"]


def test_text_from_a_string():
    async def fn(client, llm, http):
        r = await client.responses.create(model=MODEL, input="Say hi", max_output_tokens=5)
        assert r.id.startswith("resp_") and r.object == "response" and r.model == "fake-model"
        assert r.output_text == "Hello" and r.status == "incomplete"
        assert r.usage.output_tokens_details.reasoning_tokens == 0  # no reasoning parser
        assert r.incomplete_details.reason == "max_output_tokens"
        (item,) = r.output
        assert item.type == "message" and item.role == "assistant" and item.status == "completed"
        prompt_len = await _prompt_len(http, [{"role": "user", "content": "Say hi"}])
        assert r.usage.input_tokens == prompt_len and r.usage.output_tokens == 5
        assert r.usage.total_tokens == r.usage.input_tokens + 5
    _with_client(fn)


def test_a_reply_that_ends_is_completed():
    async def fn(client, llm, http):
        r = await client.responses.create(model=MODEL, input="x", max_output_tokens=40)
        assert r.status == "completed" and r.output_text == "Hello"
    _with_client(fn, text="Hello|")


def test_instructions_and_message_items_make_the_prompt():
    async def fn(client, llm, http):
        r = await client.responses.create(model=MODEL, 
            instructions="Be brief.", max_output_tokens=3,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                {"type": "input_text", "text": "b"}]},
                   {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
                   {"type": "message", "role": "user", "content": "d"}])
        prompt_len = await _prompt_len(http, [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "a\nb"},
                               {"role": "assistant", "content": "c"},
                               {"role": "user", "content": "d"}])
        assert r.usage.input_tokens == prompt_len and r.instructions == "Be brief."
    _with_client(fn)


def test_stream_events_in_order_and_the_text_assembled():
    async def fn(client, llm, http):
        kinds, seqs, text = [], [], ""
        async with client.responses.stream(model=MODEL, input="Say hi", max_output_tokens=8) as stream:
            async for event in stream:
                kinds.append(event.type)
                seqs.append(event.sequence_number)
                if event.type == "response.output_text.delta":
                    text += event.delta
            final = await stream.get_final_response()
        assert seqs == list(range(len(seqs)))
        assert kinds[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        assert text == "Hello wo" == final.output_text
        assert final.usage.output_tokens == 8 and final.status == "incomplete"
    _with_client(fn)


def test_stream_ends_with_response_completed():
    async def fn(client, llm, http):
        async with client.responses.stream(model=MODEL, input="x", max_output_tokens=20) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        assert kinds[-1] == "response.completed" and final.output_text == "Hi"
        assert final.status == "completed"
    _with_client(fn, text="Hi|")


def test_previous_response_id_continues_the_conversation():
    async def fn(client, llm, http):
        first = await client.responses.create(model=MODEL, instructions="old", input="one", max_output_tokens=3)
        second = await client.responses.create(model=MODEL, previous_response_id=first.id, input="two",
                                               instructions="new", max_output_tokens=3)
        # the earlier instructions are not carried over; the earlier turns are
        prompt_len = await _prompt_len(http, [{"role": "system", "content": "new"},
                               {"role": "user", "content": "one"},
                               {"role": "assistant", "content": "Hel"},
                               {"role": "user", "content": "two"}])
        assert second.usage.input_tokens == prompt_len
        assert second.previous_response_id == first.id
        third = await client.responses.create(model=MODEL, previous_response_id=second.id, input="three",
                                              max_output_tokens=3, store=False)
        assert third.usage.input_tokens > second.usage.input_tokens
        got = await client.responses.retrieve(second.id)
        assert got.id == second.id and got.output_text == second.output_text
        with pytest.raises(openai.NotFoundError, match=third.id):  # store=false: not kept
            await client.responses.retrieve(third.id)
    _with_client(fn)


def test_a_stream_is_stored_too():
    async def fn(client, llm, http):
        async with client.responses.stream(model=MODEL, input="one", max_output_tokens=3) as stream:
            first = await stream.get_final_response()
        second = await client.responses.create(model=MODEL, previous_response_id=first.id, input="two",
                                               max_output_tokens=3)
        prompt_len = await _prompt_len(http, [{"role": "user", "content": "one"},
                               {"role": "assistant", "content": "Hel"},
                               {"role": "user", "content": "two"}])
        assert second.usage.input_tokens == prompt_len
    _with_client(fn)


def test_unknown_and_evicted_ids_are_404s_naming_the_id():
    async def fn(client, llm, http):
        with pytest.raises(openai.NotFoundError, match="resp_nope") as e:
            await client.responses.create(model=MODEL, previous_response_id="resp_nope", input="x")
        assert e.value.body["param"] == "previous_response_id"
        ids = [(await client.responses.create(model=MODEL, input="x", max_output_tokens=1)).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError, match=ids[0]):
            await client.responses.create(model=MODEL, previous_response_id=ids[0], input="x")
        await client.responses.create(model=MODEL, previous_response_id=ids[2], input="x", max_output_tokens=1)
    _with_client(fn, responses_store_size=2)


def test_delete_removes_a_stored_response():
    async def fn(client, llm, http):
        r = await client.responses.create(model=MODEL, input="x", max_output_tokens=2)
        assert (await client.responses.retrieve(r.id)).id == r.id
        deleted = await http.delete(f"/v1/responses/{r.id}")
        assert deleted.status_code == 200
        assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError, match=r.id):
            await client.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError, match=r.id):  # nothing to continue from
            await client.responses.create(model=MODEL, previous_response_id=r.id, input="y")
        again = await http.delete(f"/v1/responses/{r.id}")
        assert again.status_code == 404 and r.id in again.json()["error"]["message"]
        assert again.json()["error"]["code"] == 404
        with pytest.raises(openai.NotFoundError, match="resp_nope"):
            await client.responses.delete("resp_nope")
        other = await client.responses.create(model=MODEL, input="x", max_output_tokens=2)
        await client.responses.delete(other.id)  # the openai client's own call
        assert (await http.get(f"/v1/responses/{other.id}")).status_code == 404
    _with_client(fn)


def test_function_call_items_become_the_tool_loop_messages():
    from slipstream.server.serving_responses import input_messages
    messages = input_messages([
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]}])
    assert messages == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]


def test_output_items_from_a_chat_reply():
    from slipstream.server.serving_responses import output_items
    items = output_items({"content": None, "reasoning_content": "hmm", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]})
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert items[1]["call_id"] == "call_1" and items[1]["name"] == "get"
    assert [i["type"] for i in output_items({"content": ""})] == ["message"]


def test_tools_and_text_format_in_chat_shape():
    from slipstream.server.protocol_responses import ResponsesRequest
    from slipstream.server.serving_responses import chat_tools, response_format
    req = ResponsesRequest(input="x", tools=[{"type": "function", "name": "get", "parameters": {
        "type": "object"}, "strict": True}], tool_choice={"type": "function", "name": "get"})
    assert chat_tools(req) == {
        "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"},
                                                    "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get"}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format({"format": {"type": "json_schema", "name": "A", "schema": schema}}) == {
        "type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
    assert response_format({"format": {"type": "text"}}) is None
    assert response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}


def test_reasoning_items_with_a_reasoning_parser():
    async def fn(client, llm, http):
        r = await client.responses.create(model=MODEL, input="2+2?", max_output_tokens=len(thought))
        assert [i.type for i in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "Add." and r.output_text == "4."
        kinds, reasoning = [], ""
        async with client.responses.stream(model=MODEL, input="2+2?", max_output_tokens=len(thought)) as s:
            async for event in s:
                kinds.append(event.type)
                if event.type == "response.reasoning_text.delta":
                    reasoning += event.delta
            final = await s.get_final_response()
        assert reasoning == "Add." and final.output_text == "4."
        assert [i.type for i in final.output] == ["reasoning", "message"]
        # the thinking's tokens (the fake engine's are bytes), tags included
        thinking = len("<think>Add.</think>")
        assert r.usage.output_tokens_details.reasoning_tokens == thinking
        assert final.usage.output_tokens_details.reasoning_tokens == thinking
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "<think>Add.</think>4."
    _with_client(fn, text=thought, reasoning_parser="qwen3")


@pytest.mark.parametrize("field,value,param", [
    ("tools", [{"type": "web_search"}], "tools[0].type"),
    ("tools", [{"type": "file_search", "vector_store_ids": ["v"]}], "tools[0].type"),
    ("tools", [{"type": "code_interpreter", "container": {"type": "auto"}}], "tools[0].type"),
    ("background", True, "background"),
    ("include", ["reasoning.encrypted_content"], "include"),
    ("truncation", "auto", "truncation"),
    ("reasoning", {"effort": "high"}, "reasoning.effort"),
    ("text", {"format": {"type": "grammar"}}, "text.format.type"),
    ("max_output_tokens", 0, "max_output_tokens"),
    ("input", [{"type": "input_image", "image_url": "x"}], "input[0].type"),
    ("input", [{"role": "user", "content": [{"type": "input_image"}]}], "input[0].content[0].type"),
    ("input", [{"role": "robot", "content": "x"}], "input[0].role"),
])
def test_what_this_server_does_not_have_is_a_400_naming_the_field(field, value, param):
    async def fn(client, llm, http):
        r = await http.post("/v1/responses", json={"input": "x", field: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert not llm.finished  # nothing ran
    _with_client(fn)


def test_not_used_values_are_accepted():
    async def fn(client, llm, http):
        r = await http.post("/v1/responses", json={
            "input": "x", "max_output_tokens": 2, "background": False, "include": [],
            "truncation": "disabled", "reasoning": {"effort": None}, "store": False,
            "text": {"format": {"type": "text"}}, "metadata": {"k": "v"}})
        assert r.status_code == 200, r.text
        assert r.json()["metadata"] == {"k": "v"}
    _with_client(fn)


def test_the_store_is_a_bounded_lru():
    from slipstream.server.errors import APIError
    from slipstream.server.responses_store import ResponseStore, StoredResponse
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(StoredResponse({"id": rid}, []))
    store.get("a")  # now the most recently used
    store.put(StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(APIError, match="'b'"):
        store.get("b")
    empty = ResponseStore(0)
    empty.put(StoredResponse({"id": "a"}, []))
    assert len(empty) == 0


def test_the_store_size_flag():
    import argparse

    from slipstream.cli.serve import _check_flags, add_serve_parser
    sub = argparse.ArgumentParser().add_subparsers()
    p = add_serve_parser(sub, lambda p: None)
    assert p.parse_args([]).responses_store_size == 1000
    with pytest.raises(ValueError, match="--responses-store-size must be >= 0"):
        _check_flags(p.parse_args(["--responses-store-size", "-1"]))


def test_the_route_is_behind_the_api_key():
    async def fn(client, llm, http):
        r = await http.post("/v1/responses", json={"input": "x"})
        assert r.status_code == 401
    _with_client(fn, api_key="k")


def test_the_stored_conversation_keeps_the_calls():
    from slipstream.server.protocol_responses import ResponsesRequest
    from slipstream.server.serving_responses import (PreparedResponse, conversation_after,
                                                     function_call_item, message_item,
                                                     reasoning_item)
    prep = PreparedResponse(ResponsesRequest(input="q"), None, [{"role": "user", "content": "q"}],
                            "resp_1", 0)
    output = [reasoning_item("hmm"), message_item("Let me look."),
              function_call_item("c1", "get", "{}")]
    assert conversation_after(prep, output) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}]


class FailingLLM(FakeAsyncLLM):
    """The fake engine failing after its second output."""

    async def generate(self, *args, **kwargs):
        n = 0
        async for out in super().generate(*args, **kwargs):
            yield out
            n += 1
            if n == 2:
                raise RuntimeError("boom")


def test_an_engine_error_after_the_start_is_an_error_event():
    async def body(http, llm):
        r = await http.post("/v1/responses", json={"input": "x", "max_output_tokens": 10,
                                                   "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert [e["type"] for e in events][-3:] == ["response.output_text.delta",
                                                    "response.output_text.delta", "error"]
        assert "boom" in events[-1]["message"] and events[-1]["code"] == "500"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    run_app(body, FailingLLM())
