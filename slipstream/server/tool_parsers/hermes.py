"""Hermes markup (Qwen2.5, Qwen3, NousResearch Hermes): each call is
<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, calls one after another."""
from __future__ import annotations

from typing import Any

from slipstream.server.tool_parsers.base import NEED_MORE, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (OPEN,)

    call_begin = OPEN + '\n{{"name": {name}, "arguments": '
    call_end = "}\n" + CLOSE
    call_separator = "\n"

    def read_calls(self, text: str, final: bool) -> tuple[int, list[dict[str, Any]]] | None:
        lead = len(text) - len(text.lstrip())
        if not text.startswith(OPEN, lead):
            if lead == len(text):  # whitespace after the calls
                return NEED_MORE if not final else (len(text), [])
            if not final and OPEN.startswith(text[lead:]):
                return NEED_MORE
            return 0, []
        body = lead + len(OPEN)
        body += len(text[body:]) - len(text[body:].lstrip())
        close = text.find(CLOSE, body)
        found = self.json_at(text, body, final)
        if found is NEED_MORE:
            return NEED_MORE
        if found is not False:
            end, value = found
            after = text[end:].lstrip()
            if after.startswith(CLOSE) or (final and not after):  # EOS may come before the tag
                call = self.call_of(value, ("arguments",))
                used = len(text) - len(after) + (len(CLOSE) if after else 0)
                return used, [call] if call else []
            if not final and CLOSE.startswith(after):
                return NEED_MORE
        # malformed: everything up to the closing tag stays content
        if close < 0:
            return NEED_MORE if not final else (len(text), [])
        return close + len(CLOSE), []

    def partial_calls(self, text: str) -> list[tuple[str, Any, bool]]:
        lead = len(text) - len(text.lstrip())
        if not text.startswith(OPEN, lead):
            return []
        body = lead + len(OPEN)
        body += len(text[body:]) - len(text[body:].lstrip())
        return self.partial_call_of(text, body, ("arguments",))
