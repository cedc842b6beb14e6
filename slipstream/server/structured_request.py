"""The request fields that constrain the output, as one `StructuredOutputsParams`.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's
`structured_outputs` object and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields all say the same thing; a request may use one of them. The
constraint is compiled here, at the front door, without a tokenizer (xgrammar parses the
schema, regex or grammar), so a bad one is a 400 naming what is wrong instead of an engine
request that fails later.
"""
from __future__ import annotations

import functools
import re

from slipstream.sampling.structured import StructuredOutputsParams
from slipstream.server.errors import bad_request

# xgrammar's C++ errors start with a time and a source location
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
         "structural_tag": "structural tag"}

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _sources(req) -> list[str]:
    given = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.get("type", "text") != "text":
        given.append("response_format")
    if req.structured_outputs is not None:
        given.append("structured_outputs")
    given += [name for name in GUIDED_FIELDS if getattr(req, name) is not None]
    return given


def structured_outputs_of(req) -> StructuredOutputsParams | None:
    """The request's constraint (None: none); a 400 names the field when it is malformed,
    does not compile, or is given twice."""
    given = _sources(req)
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {' and '.join(given)}", given[1])
    field = given[0]
    try:
        if field == "response_format":
            params = StructuredOutputsParams.from_response_format(req.response_format)
        elif field == "structured_outputs":
            params = StructuredOutputsParams.from_dict(req.structured_outputs)
        else:
            params = StructuredOutputsParams(**{GUIDED_FIELDS[field]: getattr(req, field)})
    except ValueError as e:
        raise bad_request(f"{field}: {e}", field) from None
    check_compiles(params, field)
    return params


def check_compiles(params: StructuredOutputsParams, field: str) -> None:
    """A 400 naming `field` when the constraint does not compile (the tokenizer-free half of
    the engine's compile; the result is cached by the constraint's key)."""
    error = _compile_error(params.key())
    if error is not None:
        raise bad_request(f"{field}: {error}", field)


@functools.lru_cache(maxsize=256)
def _compile_error(key) -> str | None:
    try:
        import xgrammar as xgr
    except ImportError:  # no backend here: the engine reports what it cannot compile
        return None
    kind, spec, _ = key
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            if "::=" in spec:
                xgr.Grammar.from_ebnf(spec)
            else:
                xgr.Grammar.from_lark(spec)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec)
    except Exception as e:  # xgrammar raises RuntimeError and its own types
        lines = [line for line in str(e).splitlines() if line.strip()]
        text = _LOCATION.sub("", lines[0]) if lines else type(e).__name__
        return f"invalid {_WHAT[kind]}: {text[:300]}"
    return None
