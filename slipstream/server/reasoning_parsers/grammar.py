"""A structured output under a reasoning parser: the constraint applies from the end of the
thinking on. The request's constraint becomes one xgrammar structural tag, a sequence of the
parser's free thinking part (any text up to the closing tag), up to four whitespace
characters, then the constraint itself, so the thinking is never masked and the answer is."""
from __future__ import annotations

import json
from typing import Any

from slipstream.sampling.structured import StructuredOutputsParams
from slipstream.server.reasoning_parsers.base import ReasoningParser

_ANY_OBJECT = {"type": "object"}
# the whitespace a model writes after its thinking ("</think>\n\n"): ASCII and bounded, so a
# model held back from prose cannot drift into whitespace instead (regex \s takes Unicode
# spaces, without end)
_GAP = r"[ \t\r\n]{0,4}"


def constraint_format(so: StructuredOutputsParams) -> dict[str, Any]:
    """The structural-tag format of one constraint (StructuredOutputsParams.kind)."""
    kind = so.kind
    if kind == "json":
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return {"type": "json_schema", "json_schema": schema}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": _ANY_OBJECT}
    if kind == "regex":
        return {"type": "regex", "pattern": so.regex}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in so.choice]}
    if kind == "grammar":
        return {"type": "grammar", "grammar": so.grammar,
                "syntax": "ebnf" if "::=" in so.grammar else "lark"}
    tag = json.loads(so.structural_tag) if isinstance(so.structural_tag, str) else so.structural_tag
    if "format" not in tag:
        raise ValueError("a structural tag without 'format' (the legacy structures/triggers "
                         "form) cannot follow a reasoning parser's thinking")
    return tag["format"]


def after_reasoning(parser: ReasoningParser, so: StructuredOutputsParams) -> StructuredOutputsParams:
    """`so` with the parser's free thinking part in front of it."""
    elements = [parser.reasoning_format(), {"type": "regex", "pattern": _GAP},
                constraint_format(so)]
    return StructuredOutputsParams(structural_tag={
        "type": "structural_tag", "format": {"type": "sequence", "elements": elements}})
