"""What a tool-call parser is: it reads the calls a model wrote in its family's markup.

A family (one file each: hermes.py, llama3_json.py, mistral.py) says where a tool section
starts (`start_markers`) and how to read one call, or a run of calls, from the text at that
point (`read_calls`). `ToolCallStream` is the one state machine over those hooks: fed the
generated text in pieces, it gives content deltas and whole tool calls, holding back text
that may still become markup, so markup never reaches the content. `extract` is the same
machine fed the whole text at once, so a stream split anywhere assembles to what `extract`
returns. Markup that does not read as a call (malformed JSON, no name) stays content.

A stream made with `partial=True` (the server's) also gives the calls' arguments as they are
written (`StreamDelta.arguments`: fragments of each call's final arguments text, from the
family's `partial_calls`; arguments_stream.py). A call told that way is committed: should
its markup then turn out malformed, that markup is dropped rather than given out as content
(the client already has the call).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from slipstream.server.tool_parsers.arguments_stream import ArgumentsDelta, ArgumentsTeller
from slipstream.server.tool_parsers.partial import partial_json

__all__ = ["NEED_MORE", "ArgumentsDelta", "ExtractedToolCalls", "StreamDelta", "ToolCall",
           "ToolCallStream", "ToolParser", "new_call_id"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=new_call_id)
    type: str = "function"
    index: int = 0  # its place among the reply's calls

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text that is not a call (None: nothing but calls)
    tool_calls: list[ToolCall]


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed by this piece
    arguments: list[ArgumentsDelta] = field(default_factory=list)  # partial streams only


NEED_MORE = None  # read_calls: the text so far may still become a call


class ToolParser:
    """One model family's tool-call markup. Subclasses set `name`, `start_markers` and
    write `read_calls`; `keep_special_tokens` says the markup is made of special tokens
    (the request must decode them for the parser to see them)."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]] = ()
    starts_only_at_beginning: ClassVar[tuple[str, ...]] = ()  # markers that count only first
    keep_special_tokens: ClassVar[bool] = False

    # How a forced call is written (tool_choice "required" or a named tool): each call is
    # call_begin (with {name}, the name as a JSON string), the arguments, call_end; calls
    # are joined by call_separator, the whole between calls_prefix and calls_suffix.
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    call_separator: ClassVar[str]
    calls_prefix: ClassVar[str] = ""
    calls_suffix: ClassVar[str] = ""

    def constraint(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """An xgrammar structural tag whose sentences are calls, in this family's markup, of
        the given functions ({"name", "parameters": JSON schema}): one or more when
        `parallel`, else exactly one; the arguments follow each function's schema."""
        tags = [{"type": "tag", "begin": self.call_begin.format(name=json.dumps(f["name"])),
                 "content": {"type": "json_schema",
                             "json_schema": f.get("parameters") or {"type": "object"}},
                 "end": self.call_end} for f in functions]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.call_separator,
                 "at_least_one": True, "stop_after_first": not parallel}
        elements = [{"type": "const_string", "value": self.calls_prefix}] if self.calls_prefix else []
        elements.append(calls)
        if self.calls_suffix:
            elements.append({"type": "const_string", "value": self.calls_suffix})
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}

    def read_calls(self, text: str, final: bool) -> tuple[int, list[dict[str, Any]]] | None:
        """Read from `text`, which starts at a marker (or after calls already read): None
        (NEED_MORE) while the calls may still be incomplete; else (characters used, calls as
        {"name", "arguments"} dicts). Used characters with no calls are content (malformed
        markup), unless only whitespace (between calls: dropped); (0, []) ends the tool section, and is never the answer at a start marker."""
        raise NotImplementedError

    def partial_calls(self, text: str) -> list[tuple[str, Any, bool]]:
        """The calls being written in `text` (as read_calls gets it, while it answers
        NEED_MORE): (name, arguments so far, whether they are whole), only calls whose name
        is whole and whose arguments have begun. A family without it streams each call whole."""
        return []

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = ToolCallStream(self)
        first, last = stream.feed(text), stream.finish()
        content = first.content + last.content
        calls = first.tool_calls + last.tool_calls
        return ExtractedToolCalls(content if content or not calls else None, calls)

    def stream(self, partial: bool = False) -> ToolCallStream:
        return ToolCallStream(self, partial)

    # helpers for the families
    @staticmethod
    def call_of(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> dict | None:
        """{"name", "arguments": JSON text} of a parsed call object; None if it is not one."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args: Any = {}
        for key in args_keys:
            if key in obj:
                args = obj[key]
                break
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}

    @staticmethod
    def json_at(text: str, pos: int, final: bool) -> tuple[int, Any] | None | bool:
        """The JSON value starting at `pos`: (end, value); None (NEED_MORE) if it may still be
        incomplete; False if it cannot be JSON."""
        try:
            value, end = _DECODER.raw_decode(text, pos)
            return end, value
        except ValueError:
            if final or _closes(text, pos):
                return False
            return NEED_MORE

    @staticmethod
    def partial_call_of(text: str, pos: int,
                        args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list:
        """partial_calls' entry for a call object starting at `pos` ({"name", args_keys[i]:
        {...}}): whole if it decodes, else read by partial-json-parser; [] until its name is
        followed by the arguments' opening brace."""
        whole = True
        try:
            value, _ = _DECODER.raw_decode(text, pos)
        except ValueError:
            value, whole = partial_json(text[pos:]), False
        return ToolParser.partial_entry(value, whole, args_keys)

    @staticmethod
    def partial_entry(value: Any, whole: bool, args_keys: tuple[str, ...]) -> list:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        for key in args_keys:  # the key call_of reads the arguments from
            if key in value:
                args = value[key]  # a dict once its brace is written: the name is whole
                return [(value["name"], args, whole)] if isinstance(args, dict) else []
        return []


_DECODER = json.JSONDecoder()


def _closes(text: str, pos: int) -> bool:
    """Whether the bracketed value starting at `pos` has been closed (so a decode error is
    final, not a value still arriving)."""
    depth, in_string, escaped = 0, False, False
    for ch in text[pos:]:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth <= 0:
                return True
    return False


class ToolCallStream:
    """Feed generated text, get content and completed tool calls (see the module doc)."""

    def __init__(self, parser: ToolParser, partial: bool = False):
        self.parser = parser
        self.pending = ""  # text not yet given out
        self.in_tools = False
        self.seen_text = False  # anything but whitespace given out as content yet
        self.count = 0  # calls completed (and committed calls whose markup broke)
        self.told = 0  # calls told as partial: indices below it are committed
        self.teller = ArgumentsTeller(parser.partial_calls) if partial else None

    def feed(self, text: str) -> StreamDelta:
        self.pending += text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        while self.pending:
            if not self.in_tools:
                start, hold = self._find_start(final)
                content = self.pending[:start]
                if content:
                    out.content += content
                    self.seen_text = self.seen_text or bool(content.strip())
                    self._cut(start)
                if hold:
                    break
                self.in_tools = True
                continue
            # inside a string value (partial streams know) no call can be whole yet
            in_string = self.teller is not None and not final and self.teller.in_string(self.pending)
            read = NEED_MORE if in_string else self.parser.read_calls(self.pending, final)
            if read is NEED_MORE:
                break
            used, calls = read
            if used == 0:  # not (or no longer) a tool section: back to content
                self.in_tools = False
                self.seen_text = True
                continue
            if calls:
                for i, c in enumerate(calls):
                    out.tool_calls.append(ToolCall(c["name"], c["arguments"], index=self.count + i))
                    if self.teller is not None:
                        out.arguments += self.teller.finish(self.count + i, c["name"], c["arguments"])
                self.count += len(calls)
            elif self.told > self.count:  # committed calls whose markup broke: dropped
                self.count = self.told
            elif self.pending[:used].strip():  # markup that is no call: content
                out.content += self.pending[:used]
                self.seen_text = True
            self.told = max(self.told, self.count)
            self._cut(used)
        if self.teller is not None and self.in_tools and self.pending and not final:
            fragments, writing = self.teller.tell(self.pending, self.count)
            out.arguments += fragments
            self.told = max(self.told, self.count + writing)
        return out

    def _cut(self, used: int) -> None:
        self.pending = self.pending[used:]
        if self.teller is not None:
            self.teller.cut()

    def _find_start(self, final: bool) -> tuple[int, bool]:
        """(where a tool section starts in the pending text, or how much of it is content
        for sure; whether to stop and wait there)."""
        text = self.pending
        best = len(text)
        for marker in self.parser.start_markers:
            i = text.find(marker)
            if i >= 0:
                best = min(best, i)
        if not self.seen_text and self.count == 0:
            lead = len(text) - len(text.lstrip())
            for marker in self.parser.starts_only_at_beginning:
                if text[lead:].startswith(marker):
                    return 0, False  # the leading whitespace goes with the call
                if not final and marker.startswith(text[lead:]):
                    return 0, True
        if best < len(text):
            return best, False
        if final:
            return len(text), True
        # hold back a tail that may be the beginning of a marker
        hold = len(text)
        for marker in self.parser.start_markers:
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    hold = min(hold, len(text) - k)
                    break
        return hold, True
