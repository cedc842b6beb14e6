"""Structured outputs: the constraint a request puts on its generated text (vLLM's names).

`StructuredOutputsParams` holds exactly one constraint: a JSON schema (`json`), a regular
expression (`regex`), a list of allowed completions (`choice`), an EBNF / GBNF (or Lark)
grammar (`grammar`), any JSON object (`json_object`), or an xgrammar structural
tag (`structural_tag`). It is checked when built; every error is a one-line `ValueError` naming
the field. It travels to the engine core as a plain dict (`to_dict` / `from_dict`), and
`key()` is what the grammar compiler caches a compiled grammar under.

This module imports neither torch nor a grammar library: front ends build and check these
params without loading either.
"""
from __future__ import annotations

import dataclasses
import json as jsonlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["CONSTRAINT_FIELDS", "GrammarKey", "StructuredOutputsParams"]

#: The fields of which exactly one is set, in the order `key()` reports them.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class GrammarKey(NamedTuple):
    """The canonical form of a constraint: equal keys compile to the same grammar.

    kind: the constraint field that is set; spec: its canonical text (JSON for schemas, tags
    and choices, the text itself for regex and grammar, "" for json_object);
    fixed_whitespace: `disable_any_whitespace`, which changes the JSON grammars."""
    kind: str
    spec: str
    fixed_whitespace: bool


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def one_line(text) -> str:
    """`text` (an error, a message) on one line, its whitespace runs single spaces."""
    return " ".join(str(text).split())


def _canonical_json(value: Any) -> str:
    # Key order is kept: JSON schema properties are generated in their declared order, so two
    # schemas that differ only in that order are different grammars.
    return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json_document(name: str, value: Any, allowed: tuple[type, ...], what: str) -> Any:
    """A JSON document given as a str or as its parsed value; returns the parsed value."""
    if isinstance(value, str):
        try:
            parsed = jsonlib.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} must be {what}; the string is not valid JSON: "
                             f"{one_line(e)}") from None
    else:
        parsed = value
    if not isinstance(parsed, allowed):
        raise ValueError(f"{name} must be {what}, got {_describe(value)} "
                         f"({type(parsed).__name__})")
    try:
        _canonical_json(parsed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be {what} of plain JSON values: {one_line(e)}") from None
    return parsed


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output; the other constraint fields stay None.

    json                    a JSON schema: a dict (or bool) or its JSON text. Properties the
                            schema does not declare are not generated.
    regex                   a regular expression the whole output matches.
    choice                  a non-empty list of non-empty strings; the output is one of them
                            (stored as a tuple, duplicates dropped, order kept).
    grammar                 an EBNF (GBNF) grammar, rules written ``name ::= ...``, start
                            rule ``root``; without ``::=`` a Lark grammar (rule ``start``).
    json_object             True: the output is any JSON object.
    structural_tag          an xgrammar structural tag: a dict or its JSON text.
    disable_any_whitespace  json / json_object only: JSON is written json.dumps's way, with
                            ", " and ": " as separators and no other whitespace (vLLM's
                            meaning); otherwise any whitespace may go between JSON tokens.
    """

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            _json_document("json", self.json, (dict, bool),
                           "a JSON schema (a dict or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty str, got {_describe(value)}")
        if self.choice is not None:
            object.__setattr__(self, "choice", self._normalise_choice(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {_describe(self.json_object)}")
        if self.structural_tag is not None:
            _json_document("structural_tag", self.structural_tag, (dict,),
                           "a structural tag (a dict or its JSON text)")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be a bool, "
                             f"got {_describe(self.disable_any_whitespace)}")
        given = [name for name in CONSTRAINT_FIELDS if self._is_set(name)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of "
                             f"{', '.join(CONSTRAINT_FIELDS)}; got "
                             f"{', '.join(given) if given else 'none'}")

    @staticmethod
    def _normalise_choice(choice: Any) -> tuple[str, ...]:
        allowed = "a non-empty list of non-empty str"
        if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)) or not choice:
            raise ValueError(f"choice must be {allowed}, got {_describe(choice)}")
        result: list[str] = []
        for i, item in enumerate(choice):
            if not isinstance(item, str) or not item:
                raise ValueError(f"choice must be {allowed}, got {_describe(choice)} "
                                 f"(item {i} is {_describe(item)})")
            if item not in result:
                result.append(item)
        return tuple(result)

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        # json_object=False asks for nothing (vLLM's default), like None.
        return value is not None and not (name == "json_object" and value is False)

    @property
    def kind(self) -> str:
        """The constraint field that is set."""
        return next(name for name in CONSTRAINT_FIELDS if self._is_set(name))

    def key(self) -> GrammarKey:
        """The canonical, hashable form of the constraint (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            parsed = jsonlib.loads(value) if isinstance(value, str) else value
            spec = _canonical_json(parsed)
        elif kind == "choice":
            spec = _canonical_json(list(value))
        elif kind == "json_object":
            spec = ""
        else:
            spec = value
        fixed = self.disable_any_whitespace and kind in ("json", "json_object")
        return GrammarKey(kind, spec, fixed)

    def __hash__(self) -> int:
        # The generated hash would hash a schema dict, which fails.
        return hash(self.key())

    # ------------------------------------------------------------------ wire
    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as plain JSON values (choice a list)."""
        result: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                result[f.name] = list(value) if f.name == "choice" else value
        return result

    @classmethod
    def from_response_format(cls, response_format: Any) -> StructuredOutputsParams | None:
        """OpenAI's `response_format`: {"type": "text"} (None: no constraint), {"type":
        "json_object"}, or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
        if not isinstance(response_format, Mapping):
            raise ValueError(f"response_format must be an object, got {_describe(response_format)}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., '
                                 '"schema": {...}}}')
            return cls(json=spec["schema"])
        raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', "
                         f"got {_describe(kind)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructuredOutputsParams:
        """Build from a mapping such as `to_dict`'s; unknown names raise ValueError."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"structured_outputs must be a mapping of field names to values, "
                             f"got {_describe(data)} ({type(data).__name__})")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}; "
                             f"allowed: {', '.join(names)}")
        return cls(**{k: v for k, v in data.items() if v is not None})
