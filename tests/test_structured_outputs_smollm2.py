"""Structured outputs end to end on the embedded SmolLM2-135M-Instruct (CPU): JSON schemas that
jsonschema validates, regex, choice and EBNF grammars obeyed, a mixed batch, the chat API,
AsyncLLM over the wire to a core process, and the rows of `generate --input`."""
import asyncio
import json
import re

import jsonschema
import pytest

from slipstream import LLM, AsyncLLM, SamplingParams, StructuredOutputsParams
from slipstream.frontend.batch_rows import RowDefaults, parse_row

pytestmark = pytest.mark.slow

ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
            "required": ["name", "email"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {
                "sku": {"enum": ["A1", "B2", "C3"]},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "quantity"]}},
        "priority": {"enum": ["low", "high"]},
        "discount": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["customer", "items", "priority", "discount"],
}
SCORE = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 10},
                                          "reason": {"type": "string", "maxLength": 30}},
         "required": ["score", "reason"]}


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=512)


def greedy(constraint, max_tokens=160, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=constraint, **kw)


def test_json_schemas_validate_in_a_batch_with_free_requests(llm):
    # (JSON written json.dumps's way: with any whitespace allowed, a small model may pad forever)
    params = [greedy(StructuredOutputsParams(json=ORDER, disable_any_whitespace=True)),
              SamplingParams(max_tokens=10, temperature=0),
              greedy(StructuredOutputsParams(json=SCORE, disable_any_whitespace=True), max_tokens=40),
              SamplingParams(max_tokens=10, temperature=0.8, seed=1)]
    prompts = ["Write an order for two items as JSON.", "The capital of France is",
               "Rate this movie from 0 to 10: great acting, weak plot.", "Once upon a time"]
    outs = llm.generate(prompts, params)
    for out, schema in ((outs[0], ORDER), (outs[2], SCORE)):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert [len(o.outputs[0].token_ids) for o in (outs[1], outs[3])] == [10, 10]
    stats = llm.engine.stats()
    assert stats["constrained_requests"] == 2 and stats["grammar_compile_seconds"] > 0


def test_regex_choice_and_grammar_are_obeyed(llm):
    outs = llm.generate(
        ["My phone number is", "Is the sky blue? Answer:", "Write an arithmetic sum:"],
        [greedy(StructuredOutputsParams(regex=r"\d{3}-\d{4}"), max_tokens=20),
         greedy(StructuredOutputsParams(choice=["yes", "no"])),
         greedy(StructuredOutputsParams(grammar='root ::= num (" + " num)+\nnum ::= [1-9] [0-9]?'),
                max_tokens=30)])
    assert re.fullmatch(r"\d{3}-\d{4}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("yes", "no")
    text = outs[2].outputs[0].text
    assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)+", text) or outs[2].outputs[0].finish_reason == "length"
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:2])


def test_seeded_json_outputs_are_the_same_sync_and_async(llm):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, n=3,
                            structured_outputs=StructuredOutputsParams(json=SCORE, disable_any_whitespace=True))
    # the sync run is the module's engine (the CPU's default loop is sync): one engine less to load
    assert llm.engine.async_scheduling is False
    texts = {}
    for mode in (False, True):
        engine = llm if not mode else LLM(device="cpu", max_model_len=512, async_scheduling=True)
        out = engine.generate(["Rate pizza:"], params)[0]
        texts[mode] = [c.token_ids for c in out.outputs]
        for c in out.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), SCORE)
    assert texts[True] == texts[False]


def test_chat_with_a_schema(llm):
    out = llm.chat([{"role": "user", "content": "Rate the weather today from 0 to 10."}],
                   greedy(StructuredOutputsParams(json=SCORE, disable_any_whitespace=True), max_tokens=40))[0]
    jsonschema.validate(json.loads(out.outputs[0].text), SCORE)


def test_async_llm_carries_the_constraint_to_a_core_process():
    async def main():
        async with AsyncLLM(core="process", device="cpu", max_model_len=512) as alm:
            final = None
            async for out in alm.generate("Is water wet? Answer:",
                                          greedy(StructuredOutputsParams(choice=["wet", "dry"]))):
                final = out
            return final

    assert asyncio.run(main()).outputs[0].text in ("wet", "dry")


def test_batch_rows_take_structured_outputs_and_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rows = [{"prompt": "x", "structured_outputs": {"regex": "a+"}},
            {"prompt": "x", "sampling_params": {"structured_outputs": {"choice": ["p", "q"]}}},
            {"prompt": "x", "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "n", "schema": schema}}},
            {"prompt": "x", "response_format": {"type": "json_object"}},
            {"prompt": "x", "response_format": {"type": "text"}}]
    got = [parse_row(r, RowDefaults()).params.structured_outputs for r in rows]
    assert got == [StructuredOutputsParams(regex="a+"), StructuredOutputsParams(choice=["p", "q"]),
                   StructuredOutputsParams(json=schema), StructuredOutputsParams(json_object=True), None]
    with pytest.raises(ValueError, match="not both"):
        parse_row({"prompt": "x", "structured_outputs": {"regex": "a"},
                   "response_format": {"type": "json_object"}}, RowDefaults())
    with pytest.raises(ValueError, match="response_format type"):
        parse_row({"prompt": "x", "response_format": {"type": "yaml"}}, RowDefaults())
    with pytest.raises(ValueError, match="json_schema needs"):
        parse_row({"prompt": "x", "response_format": {"type": "json_schema"}}, RowDefaults())
