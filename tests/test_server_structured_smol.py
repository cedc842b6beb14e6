"""Structured outputs and tool calls end to end: `slipstream serve` with the embedded
SmolLM2 (CPU), a Hermes-style chat template (tests/data) and --tool-call-parser hermes,
driven by the openai client. The outputs are checked as the constraint says: parsed,
validated with jsonschema, matched against the regex, the choice, the grammar."""
from __future__ import annotations

import json
import os
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from server_utils import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # one `slipstream serve` for the module

TEMPLATE = os.path.join(os.path.dirname(__file__), "data", "hermes_tool_template.jinja")
ASK = [{"role": "user", "content": "Describe a person who lives in Paris, as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "code", "address", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(model="smol", temperature=0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = ServerProcess("--served-model-name", "smol", "--chat-template", TEMPLATE,
                        "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                        log_path=str(log))
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    age: int
    address: Address


def test_parse_returns_a_pydantic_object(client):
    done = client.chat.completions.parse(messages=ASK, response_format=Person, max_tokens=120,
                                         **GREEDY)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)


def test_json_schema_output_validates(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    done = client.chat.completions.create(messages=ASK, response_format=rf, max_tokens=200, **GREEDY)
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), SCHEMA)


def test_json_object_and_guided_json_on_completions(client):
    done = client.chat.completions.create(messages=ASK, response_format={"type": "json_object"},
                                          max_tokens=150, **GREEDY)
    assert isinstance(json.loads(done.choices[0].message.content), dict)
    done = client.completions.create(prompt="A person, as JSON: ", max_tokens=200,
                                     extra_body={"guided_json": SCHEMA}, **GREEDY)
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_regex_choice_and_grammar_are_obeyed(client):
    done = client.completions.create(prompt="Call me at ", max_tokens=20, **GREEDY,
                                     extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", done.choices[0].text)
    colors = ["red", "green", "blue"]
    done = client.chat.completions.create(
        messages=[{"role": "user", "content": "Name a color."}], max_tokens=5, **GREEDY,
        extra_body={"guided_choice": colors})
    assert done.choices[0].message.content in colors
    grammar = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,20}'
    done = client.chat.completions.create(
        messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=30, **GREEDY,
        extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,20}", done.choices[0].message.content)


def test_streamed_deltas_concatenate_to_the_whole_text(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    kw = dict(messages=ASK, response_format=rf, max_tokens=200, model="smol", temperature=0.8,
              seed=1234)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       client.chat.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_a_bad_schema_is_a_400_naming_it_and_the_server_answers_after(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=ASK, response_format=bad, max_tokens=5, **GREEDY)
    assert "invalid JSON schema" in str(e.value) and "nope" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client.completions.create(prompt="x", max_tokens=5, extra_body={"guided_regex": "a(b"},
                                  **GREEDY)
    ok = client.chat.completions.create(messages=ASK, max_tokens=5, **GREEDY)
    assert ok.choices[0].message.content


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_and_match_the_schema(client, choice):
    done = client.chat.completions.create(messages=WEATHER_Q, tools=[WEATHER, TIME],
                                          tool_choice=choice, max_tokens=120, **GREEDY)
    c = done.choices[0]
    assert c.finish_reason == "tool_calls"
    names = None if choice == "required" else ["get_time"]
    _check_calls(c.message.tool_calls, names)
    if names:
        assert len(c.message.tool_calls) == 1


def test_parallel_tool_calls_false_gives_one_call(client):
    done = client.chat.completions.create(messages=WEATHER_Q, tools=[WEATHER, TIME],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_tokens=120, **GREEDY)
    assert len(done.choices[0].message.tool_calls) == 1
    _check_calls(done.choices[0].message.tool_calls)


# the forced weather call, greedy: two tests ask it, the server answers it once for both
WEATHER_CALL = dict(messages=WEATHER_Q, tools=[WEATHER], tool_choice="required", max_tokens=120,
                    **GREEDY)


@pytest.fixture(scope="module")
def weather_call(client):
    return client.chat.completions.create(**WEATHER_CALL)


def test_streamed_tool_call_deltas_assemble_to_the_whole_call(client, weather_call):
    kw = WEATHER_CALL
    whole = weather_call.choices[0].message.tool_calls
    calls, content, finishes = {}, "", []
    for ch in client.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": "",
                                                  "fragments": 0})
                call["arguments"] += t.function.arguments or ""
                call["fragments"] += t.id is None  # the first delta: id, name, arguments ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert "<tool_call>" not in content and finishes == ["tool_calls"]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (t.function.name, t.function.arguments) for t in whole]
    assert all(c["fragments"] > 1 for c in calls.values())  # streamed as they are written


def test_a_full_tool_loop(client, weather_call):
    first = weather_call
    call = first.choices[0].message.tool_calls[0]
    _check_calls([call])
    messages = WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    answer = client.chat.completions.create(messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=40, **GREEDY)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # auto: the model may call or answer; either way the reply is well formed
    auto = client.chat.completions.create(messages=messages, tools=[WEATHER], max_tokens=60, **GREEDY)
    msg = auto.choices[0].message
    if msg.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls"
        assert "<tool_call>" not in (msg.content or "")
    else:
        assert msg.content


def test_tools_without_a_call_stay_content(client):
    done = client.chat.completions.create(messages=[{"role": "user", "content": "Say hello."}],
                                          tools=[WEATHER], tool_choice="none", max_tokens=10, **GREEDY)
    assert done.choices[0].message.content and not done.choices[0].message.tool_calls


def test_run_batch_takes_constraints_and_tools(tmp_path):
    import subprocess
    import sys

    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    bodies = {
        "schema": ("/v1/chat/completions", {"messages": ASK, "response_format": rf, "max_tokens": 200}),
        "regex": ("/v1/completions", {"prompt": "Call me at ", "max_tokens": 20,
                                      "guided_regex": "[0-9]{3}-[0-9]{4}"}),
        "tool": ("/v1/chat/completions", {"messages": WEATHER_Q, "tools": [WEATHER],
                                          "tool_choice": "required", "parallel_tool_calls": False,
                                          "max_tokens": 120}),
        "bad": ("/v1/completions", {"prompt": "x", "guided_regex": "a(b"}),
    }
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": url,
                                       "body": {"model": "smol", "temperature": 0, **body}}) + "\n"
                           for k, (url, body) in bodies.items()))
    proc = subprocess.run([sys.executable, "-m", "slipstream.cli", "run-batch", "-i", str(src),
                           "-o", str(dst), "--device", "cpu", "--served-model-name", "smol",
                           "--chat-template", TEMPLATE, "--tool-call-parser", "hermes"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    body = lambda k: rows[k]["response"]["body"]  # noqa: E731
    jsonschema.validate(json.loads(body("schema")["choices"][0]["message"]["content"]), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", body("regex")["choices"][0]["text"])
    (call,) = body("tool")["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])
    assert rows["bad"]["response"]["status_code"] == 400
    assert "guided_regex: invalid regex" in rows["bad"]["error"]["message"]
