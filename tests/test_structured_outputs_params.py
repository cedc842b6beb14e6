"""StructuredOutputsParams: validation, the wire form, the compile cache's key, and its place
in SamplingParams (no tokenizer, no grammar library)."""
from __future__ import annotations

import msgspec
import pytest

from slipstream.sampling.params import SamplingParams
from slipstream.sampling.structured import GrammarKey, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}}}


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of .*; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)  # False asks for nothing
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize("fields, field", [
    (dict(json="{not json"), "json"), (dict(json=3), "json"), (dict(json=[1]), "json"),
    (dict(json={"x": float("nan")}), "json"), (dict(regex=""), "regex"), (dict(regex=5), "regex"),
    (dict(choice="ab"), "choice"), (dict(choice=[]), "choice"), (dict(choice=["a", ""]), "choice"),
    (dict(choice=["a", 1]), "choice"), (dict(grammar=" "), "grammar"),
    (dict(json_object=1), "json_object"), (dict(structural_tag="[1]"), "structural_tag"),
    (dict(structural_tag=5), "structural_tag"),
    (dict(regex="a", disable_any_whitespace=1), "disable_any_whitespace"),
])
def test_params_reject_bad_types_naming_the_field(fields, field):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**fields)
    assert str(info.value).startswith(field) and "\n" not in str(info.value)


def test_params_normalise_choice_and_round_trip():
    params = StructuredOutputsParams(choice=["b", "a", "b"])
    assert params.choice == ("b", "a")
    assert params.to_dict() == {"choice": ["b", "a"]}
    for p in (params, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
              StructuredOutputsParams(structural_tag='{"type": "structural_tag"}')):
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(p.to_dict()))
        assert StructuredOutputsParams.from_dict(wire) == p
    with pytest.raises(ValueError, match="unknown structured_outputs field.*: jsn"):
        StructuredOutputsParams.from_dict({"jsn": {}})
    with pytest.raises(ValueError, match="must be a mapping"):
        StructuredOutputsParams.from_dict(["regex"])


def test_key_is_canonical_and_hashable():
    as_dict = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}}})
    as_text = StructuredOutputsParams(json='{ "type": "object",\n "properties": {"a": {}} }')
    assert as_dict.key() == as_text.key() == GrammarKey(
        "json", '{"type":"object","properties":{"a":{}}}', False)
    assert hash(as_dict) == hash(as_text)
    # property order is generation order: a different grammar
    reordered = StructuredOutputsParams(json={"properties": {"a": {}}, "type": "object"})
    assert reordered.key() != as_dict.key()
    fixed = StructuredOutputsParams(json=as_dict.json, disable_any_whitespace=True)
    assert fixed.key().fixed_whitespace and fixed.key() != as_dict.key()
    # the whitespace knob only concerns JSON
    assert (StructuredOutputsParams(regex="a", disable_any_whitespace=True).key()
            == StructuredOutputsParams(regex="a").key())
    assert StructuredOutputsParams(choice=["x", "y"]).key() == ("choice", '["x","y"]', False)
    assert StructuredOutputsParams(json_object=True).key() == ("json_object", "", False)


def test_sampling_params_carry_structured_outputs():
    import slipstream
    assert slipstream.StructuredOutputsParams is StructuredOutputsParams
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams().structured_outputs is None
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(params.to_dict()))
    assert data["structured_outputs"] == {"regex": "[0-9]+"}
    assert SamplingParams.from_dict(data) == params
    assert SamplingParams.from_validated(data) == params
    assert SamplingParams.from_validated(SamplingParams().to_dict()).structured_outputs is None
    same = StructuredOutputsParams(choice=["a"])
    assert SamplingParams(structured_outputs=same).structured_outputs is same
    assert params.clone(max_tokens=3).structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match="^structured_outputs must be a mapping"):
        SamplingParams(structured_outputs="[0-9]+")
    with pytest.raises(ValueError, match="^regex must be a non-empty str"):
        SamplingParams.from_dict({"structured_outputs": {"regex": ""}})
