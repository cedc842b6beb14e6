"""/v1/responses on `slipstream serve` with the embedded SmolLM2 (CPU), through the official
openai client: greedy text equals chat's for the same conversation, the stream assembles
to the whole response, previous_response_id continues a conversation, an unknown id is a
404, DELETE removes a stored response, --reasoning-parser leaves an unconstrained reply of a
model that does not think all answer (no reasoning tokens), and text.format's schema holds
after a free think block (its tokens counted as reasoning tokens)."""
from __future__ import annotations

import openai
import pytest

from server_utils import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # one `slipstream serve` for the module

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = ServerProcess("--served-model-name", "smol", "--reasoning-parser", "qwen3",
                        "--responses-store-size", "8", log_path=str(log))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=240)
    assert srv.terminate() == 0


def test_text_equals_chat_and_the_stream_equals_the_whole(client):
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "system", "content": "Answer in one word."},
                                {"role": "user", "content": QUESTION}],
        max_completion_tokens=8, temperature=0)
    r = client.responses.create(model="smol", instructions="Answer in one word.", input=QUESTION,
                                max_output_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert [i.type for i in r.output] == ["message"]  # SmolLM2 does not think
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    text, kinds = "", []
    with client.responses.stream(model="smol", instructions="Answer in one word.", input=QUESTION,
                                 max_output_tokens=8, temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert text == final.output_text == r.output_text
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_previous_response_id_and_an_unknown_id(client):
    first = client.responses.create(model="smol", input="My name is Ada.", max_output_tokens=4,
                                    temperature=0)
    second = client.responses.create(model="smol", previous_response_id=first.id,
                                     input="What is my name?", max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError, match="resp_unknown"):
        client.responses.create(model="smol", previous_response_id="resp_unknown", input="x")
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match=second.id):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError, match=second.id):
        client.responses.delete(second.id)


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome"]}},
        "required": ["city"], "additionalProperties": False}


def test_text_format_after_an_optional_think_block(client):
    # under --reasoning-parser qwen3 the schema comes after an optional <think> block (a
    # structural tag); kept from prose, greedy SmolLM2 opens one, thinks freely, closes it
    # and then writes the JSON
    import json
    r = client.responses.create(model="smol", input=QUESTION, max_output_tokens=60,
                                temperature=0, text={"format": {
                                    "type": "json_schema", "name": "city", "schema": CITY}})
    assert r.status == "completed" and r.output[-1].type == "message"
    assert [i.type for i in r.output[:-1]] in ([], ["reasoning"])
    assert json.loads(r.output_text)["city"] in ("Paris", "London", "Rome")
    thinking = r.usage.output_tokens_details.reasoning_tokens
    if r.output[0].type == "reasoning":  # the think block's tokens, not the JSON's
        assert 0 < thinking < r.usage.output_tokens
    else:
        assert thinking == 0
