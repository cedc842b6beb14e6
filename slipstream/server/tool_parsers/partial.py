"""Streaming a tool call's arguments while they are generated: reading unfinished JSON.

A call's final `arguments` is its JSON object re-serialized (`json.dumps`, ensure_ascii off),
not the model's raw text, so the streamed fragments must be pieces of that canonical text.
`partial_json` reads the unfinished JSON the model wrote so far (partial-json-parser closes
what is open); `arguments_prefix` writes the part of its canonical text that can no longer
change: everything but the closing brackets and the last value's unsure tail (a number or
literal may still grow, a string's last character may be half an escape or half a
surrogate pair). Each such prefix is a prefix of the final arguments, so the fragments
(each prefix minus what was sent) concatenate to them. `string_piece` decodes more raw
text of a string value alone (arguments_stream.py's fast path).
"""
from __future__ import annotations

import json
import re
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as _loads

__all__ = ["arguments_prefix", "escaped", "last_string", "partial_json", "string_piece"]


def partial_json(text: str) -> Any:
    """The value the unfinished JSON `text` has so far; None where it cannot be read."""
    if not text.strip():
        return None
    try:
        return _loads(text, Allow.ALL)
    except Exception:  # noqa: BLE001 - on text that is not JSON the library raises its
        return None  # MalformedJSON, json's errors, IndexError or AssertionError


def _full(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _open(value: Any) -> str:
    """The sure prefix of `value`'s canonical text, `value` being the last (maybe still
    growing) value read so far."""
    if isinstance(value, dict):
        if not value:
            return "{"
        *head, (key, last) = value.items()
        parts = [f"{_full(k)}: {_full(v)}" for k, v in head]
        return "{" + "".join(p + ", " for p in parts) + f"{_full(key)}: " + _open(last)
    if isinstance(value, list):
        if not value:
            return "["
        return "[" + "".join(_full(v) + ", " for v in value[:-1]) + _open(value[-1])
    if isinstance(value, str):
        return _full(value[:-1])[:-1]  # without the closing quote and the last character
    return ""  # a number or a literal: it may still grow ("1" -> "12", "tr" -> "true")


def arguments_prefix(arguments: Any, complete: bool) -> str:
    """The canonical text of a call's arguments that is sure to start its final value:
    all of it when `complete`, else the sure prefix ("" while not an object yet)."""
    if not isinstance(arguments, dict):
        return ""
    return _full(arguments) if complete else _open(arguments)


def last_string(value: Any) -> str | None:
    """The last value inside `value` (the arguments being written), if it is a string."""
    while isinstance(value, (dict, list)) and value:
        value = value[next(reversed(value))] if isinstance(value, dict) else value[-1]
    return value if isinstance(value, str) else None


# in a JSON string's raw text: an escape (maybe cut by the end) or a closing quote
_PIECE = re.compile(r'\\(?:u[0-9a-fA-F]{0,4}|.?)|"', re.DOTALL)


def string_piece(raw: str) -> tuple[str, str] | None:
    """More raw text of a JSON string, from a point outside any escape: (its decoded text,
    the raw tail held back: an escape cut by the end, or a high surrogate whose pair has
    not come); None when the string closes in it or it is not string text."""
    cut, high = len(raw), None  # high: the escape of a high surrogate just before
    for m in _PIECE.finditer(raw):
        tok = m.group()
        if tok == '"':
            return None
        if m.end() == len(raw) and (len(tok) < 2 or tok[1] == "u" and len(tok) < 6):
            cut = high.start() if high is not None and high.end() == m.start() else m.start()
        elif len(tok) == 6 and tok[1] == "u" and 0xD800 <= int(tok[2:], 16) <= 0xDBFF:
            high = m
            if m.end() == len(raw):
                cut = m.start()
    try:
        return json.loads('"' + raw[:cut] + '"'), raw[cut:]
    except ValueError:  # a raw control character, an unknown escape
        return None


def escaped(text: str) -> str:
    """`text` as it is written inside a canonical JSON string."""
    return _full(text)[1:-1]
