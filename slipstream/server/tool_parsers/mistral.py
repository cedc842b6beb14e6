"""Mistral markup, both generations; [TOOL_CALLS], [CALL_ID] and [ARGS] are special tokens.

v3 to v7 tokenizers: [TOOL_CALLS] then a JSON list of {"name", "arguments"} objects (or one
object). v11 and later: each call is [TOOL_CALLS]name[ARGS]{...arguments...} (v13 writes
[CALL_ID]id before [ARGS]), calls one after another. The first character after
[TOOL_CALLS] says which: a bracket or a brace is the JSON list, anything else a name."""
from __future__ import annotations

import re
from typing import Any

from slipstream.server.tool_parsers.base import NEED_MORE, ToolParser
from slipstream.server.tool_parsers.partial import partial_json

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]+")
_ID = re.compile(r"\w*")


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (MARKER,)
    keep_special_tokens = True

    call_begin = '{{"name": {name}, "arguments": '
    call_end = "}"
    call_separator = ", "
    calls_prefix = MARKER + "["
    calls_suffix = "]"

    def read_calls(self, text: str, final: bool) -> tuple[int, list[dict[str, Any]]] | None:
        if not text.startswith(MARKER):
            return 0, []
        pos = len(MARKER)
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        if pos >= len(text):
            return NEED_MORE if not final else (len(text), [])
        if text[pos] not in "[{":
            return self._read_named(text, final)
        found = self.json_at(text, pos, final)
        if found is NEED_MORE:
            return NEED_MORE
        if found is False:
            return len(text), []
        end, value = found
        items = value if isinstance(value, list) else [value]
        calls = [self.call_of(item, ("arguments",)) for item in items]
        if not calls or any(c is None for c in calls):
            return end, []
        return end, calls

    def _read_named(self, text: str, final: bool) -> tuple[int, list[dict[str, Any]]] | None:
        """One v11+ call: [TOOL_CALLS]name([CALL_ID]id)[ARGS]{...}."""
        args = self._args_at(text, final)
        if args is NEED_MORE or args is False:
            return args if args is NEED_MORE else (len(text), [])
        name, pos = args
        found = self.json_at(text, pos, final)
        if found is NEED_MORE:
            return NEED_MORE
        if found is False:
            return len(text), []
        end, value = found
        call = self.call_of({"name": name, "arguments": value}, ("arguments",))
        return end, [call] if call else []

    @staticmethod
    def _args_at(text: str, final: bool) -> tuple[str, int] | None | bool:
        """(the call's name, where its arguments' JSON starts); NEED_MORE while the text may
        still become that; False if it cannot."""
        name = _NAME.match(text, len(MARKER))
        if name is None or name.end() == len(text):
            return NEED_MORE if not final and name is not None else False
        pos = name.end()
        for tag, follow in ((CALL_ID, _ID), (ARGS, None)):
            if text.startswith(tag, pos):
                pos += len(tag)
                if follow is not None:
                    pos = follow.match(text, pos).end()
            elif tag.startswith(text[pos:]):  # the tag cut by the piece's end
                return NEED_MORE if not final else False
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return NEED_MORE if not final else False
        return (name.group(), pos) if text[pos] == "{" else False

    def partial_calls(self, text: str) -> list[tuple[str, Any, bool]]:
        if not text.startswith(MARKER):
            return []
        pos = len(MARKER)
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        if pos >= len(text):
            return []
        if text[pos] == "{":
            return self.partial_call_of(text, pos, ("arguments",))
        if text[pos] != "[":
            args = self._args_at(text, final=False)
            if not args:
                return []
            name, start = args
            return self.partial_entry({"name": name, "arguments": partial_json(text[start:])},
                                      False, ("arguments",))
        items = partial_json(text[pos:])
        out: list[tuple[str, Any, bool]] = []
        for i, item in enumerate(items if isinstance(items, list) else []):
            entry = self.partial_entry(item, i < len(items) - 1, ("arguments",))
            if not entry:  # a call without its name yet (or not a call): tell none after it
                break
            out += entry
        return out
