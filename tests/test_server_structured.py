"""Structured outputs at the server's front door, on the fake engine: each request field
becomes the StructuredOutputsParams the engine gets; two at once, a malformed one or one
that does not compile is a 400 naming it; constrained requests are counted on /metrics."""
import pytest

from fake_async_llm import FakeAsyncLLM, run_app
from slipstream.sampling.structured import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = [{"role": "user", "content": "x"}]


class RecordingLLM(FakeAsyncLLM):
    """The fake engine, keeping the params of every request it validates."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.params = []

    def validate(self, prompt, sampling_params=None):
        self.params.append(sampling_params)
        return super().validate(prompt, sampling_params)


MAPPING = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
     StructuredOutputsParams(grammar='root ::= "a" | "b"')),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {
        "type": "const_string", "value": "hi"}}}},
     StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
         "type": "const_string", "value": "hi"}})),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"')),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("fields,expected", MAPPING)
def test_each_field_maps_to_the_engine_constraint(path, fields, expected):
    body = {"messages": CHAT} if "chat" in path else {"prompt": "x"}

    async def go(c, llm):
        r = await c.post(path, json={**body, **fields, "max_tokens": 2})
        assert r.status_code == 200, r.text
        got = llm.params[-1].structured_outputs
        assert got == expected and (got is None or got.key() == expected.key())
    run_app(go, llm=RecordingLLM())


ERRORS = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "response_format and guided_regex", "guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
     "structured_outputs and guided_choice", "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of", "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "unknown structured_outputs field", "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format type", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema",
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     'invalid JSON schema: Unsupported type "nope"', "response_format"),
    ({"guided_json": '{"type": '}, "not valid JSON", "guided_json"),
    ({"guided_regex": "a(b"}, "invalid regex", "guided_regex"),
    ({"guided_grammar": "root ::= foo"}, "invalid grammar", "guided_grammar"),
    ({"guided_choice": []}, "choice must be", "guided_choice"),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {
        "type": "nope"}}}}, "invalid structural tag", "structured_outputs"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("fields,needle,param", ERRORS)
def test_bad_constraints_are_400s_naming_the_field(path, fields, needle, param):
    body = {"messages": CHAT} if "chat" in path else {"prompt": "x"}

    async def go(c, llm):
        r = await c.post(path, json={**body, **fields, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["param"] == param, err
        assert llm.params == []  # refused before the engine saw it
        ok = await c.post(path, json={**body, "max_tokens": 2})  # and the server answers after
        assert ok.status_code == 200
    run_app(go, llm=RecordingLLM())


def test_constrained_requests_are_counted_on_metrics():
    async def go(c, llm):
        for fields in ({"guided_regex": "a+"}, {"guided_regex": "b+"}, {"guided_choice": ["a"]}, {}):
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **fields})
            assert r.status_code == 200
        text = (await c.get("/metrics")).text
        assert 'slipstream:structured_output_requests_total{kind="regex",model_name="fake-model"} 2.0' in text
        assert 'slipstream:structured_output_requests_total{kind="choice",model_name="fake-model"} 1.0' in text
        for name in ("grammar_compile_seconds", "grammar_compiles", "grammar_cache_hits",
                     "grammar_compile_failures"):
            assert f"slipstream:{name}_total" in text
    run_app(go)


def test_grammar_stats_from_the_engine_are_exported():
    class StatsLLM(FakeAsyncLLM):
        async def stats(self):
            return {**await super().stats(), "grammar_compile_seconds": 1.5, "grammar_compiled": 3,
                    "grammar_compile_failed": 1, "grammar_cache_hits": 7, "grammar_cpu_seconds": 0.25}

    async def go(c, llm):
        text = (await c.get("/metrics")).text
        assert 'slipstream:grammar_compile_seconds_total{model_name="fake-model"} 1.5' in text
        assert 'slipstream:grammar_compiles_total{model_name="fake-model"} 3.0' in text
        assert 'slipstream:grammar_compile_failures_total{model_name="fake-model"} 1.0' in text
        assert 'slipstream:grammar_cache_hits_total{model_name="fake-model"} 7.0' in text
        assert 'slipstream:grammar_bitmask_seconds_total{model_name="fake-model"} 0.25' in text
    run_app(go, llm=StatsLLM())
