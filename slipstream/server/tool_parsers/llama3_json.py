"""Llama 3.1 / 3.2 JSON tool calls: the reply is {"name": ..., "parameters": {...}}, maybe
after <|python_tag|>, several separated by ";"."""
from __future__ import annotations

from typing import Any

from slipstream.server.tool_parsers.base import NEED_MORE, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (PYTHON_TAG,)
    starts_only_at_beginning = ("{",)
    keep_special_tokens = True  # <|python_tag|> is a special token

    call_begin = '{{"name": {name}, "parameters": '
    call_end = "}"
    call_separator = "; "

    @staticmethod
    def _call_start(text: str) -> int:
        """Where the next call's JSON would start: after whitespace, the tag or a ";"."""
        pos = len(text) - len(text.lstrip())
        if text.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
            pos += len(text[pos:]) - len(text[pos:].lstrip())
        elif text.startswith(";", pos):
            pos += 1
            pos += len(text[pos:]) - len(text[pos:].lstrip())
        return pos

    def read_calls(self, text: str, final: bool) -> tuple[int, list[dict[str, Any]]] | None:
        pos = self._call_start(text)
        if pos >= len(text):
            return NEED_MORE if not final else (len(text), [])
        if text[pos] != "{":
            return (0, []) if pos == 0 else (pos, [])
        found = self.json_at(text, pos, final)
        if found is NEED_MORE:
            return NEED_MORE
        if found is False:
            return len(text), []  # malformed: the rest stays content
        end, value = found
        call = self.call_of(value, ("parameters", "arguments"))
        return end, [call] if call else []

    def partial_calls(self, text: str) -> list[tuple[str, Any, bool]]:
        pos = self._call_start(text)
        if pos >= len(text) or text[pos] != "{":
            return []
        return self.partial_call_of(text, pos, ("parameters", "arguments"))
