"""Mistral markup: [TOOL_CALLS] then a JSON list of {"name", "arguments"} objects (v3 to v7
tokenizers); [TOOL_CALLS] is a special token."""
from __future__ import annotations

from typing import Any

from slipstream.server.tool_parsers.base import NEED_MORE, ToolParser

MARKER = "[TOOL_CALLS]"


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
