"""The argument fragments of the calls a stream is writing (ToolCallStream with partial=True).

`ArgumentsTeller` keeps what each call's arguments have been told and gives the fragments
that grow them: from the family's `partial_calls` read of the pending text
(partial.arguments_prefix: only text sure to start the final arguments, told only where it
extends what was told), and when a call completes, the rest of its arguments. So the
fragments of a call concatenate to its final arguments.

Reading the whole call again at every piece is quadratic in a long argument (a file's text,
say). While the pending text ends inside the last call's last string value (`GrowingString`,
found by reading the text once more with one character appended and seeing that string take
it), the next pieces are decoded as more of that string alone (partial.string_piece), and
the calls are not read again until a piece holds the string's closing quote.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slipstream.server.tool_parsers.partial import (arguments_prefix, escaped, last_string,
                                                    string_piece)

__all__ = ["ArgumentsDelta", "ArgumentsTeller", "GrowingString"]

SENTINEL = "\u00a7"  # any ordinary character: appended, it grows the string the text ends in

PartialCalls = Callable[[str], list[tuple[str, Any, bool]]]  # a family's partial_calls


@dataclass
class ArgumentsDelta:
    """More of call `index`'s arguments text (its name is whole)."""
    index: int
    name: str
    fragment: str


@dataclass
class GrowingString:
    """The pending text (`length` characters read) ends inside call `index`'s last string
    value; `held` is that string's last character, which arguments_prefix kept back."""
    index: int
    name: str
    length: int
    held: str
    tail: str = ""  # raw text not decoded yet (an escape cut by the piece's end)

    def grow(self, pending: str) -> str | None:
        """The text that the grown `pending` adds to the call's arguments; None when the
        string closed in it (or it is not string text): the calls must be read again."""
        piece = string_piece(self.tail + pending[self.length:])
        if piece is None:
            return None
        text, self.tail = piece
        self.length = len(pending)
        if not text:
            return ""
        text, self.held = self.held + text, ""
        return escaped(text)


@dataclass
class ArgumentsTeller:
    read_calls: PartialCalls
    sent: dict[int, list[str]] = field(default_factory=dict)  # each call's told pieces
    growing: GrowingString | None = None
    grown: str | None = None  # what `growing` added to the pending text, not yet told

    def cut(self) -> None:
        """The pending text lost its start: positions into it are void."""
        self.growing, self.grown = None, None

    def in_string(self, pending: str) -> bool:
        """Whether `pending` (grown) still ends inside the string value being written: no
        call can be whole yet; the growth is kept for `tell`."""
        if self.growing is None:
            return False
        self.grown = self.growing.grow(pending)
        if self.grown is None:
            self.growing = None
        return self.grown is not None

    def tell(self, pending: str, first: int) -> tuple[list[ArgumentsDelta], int]:
        """(fragments of the calls being written in `pending`, the first being call `first`;
        how many calls are being written)."""
        if self.grown is not None:
            g, text, self.grown = self.growing, self.grown, None
            if not text:
                return [], g.index - first + 1
            self.sent.setdefault(g.index, []).append(text)
            return [ArgumentsDelta(g.index, g.name, text)], g.index - first + 1
        entries = self.read_calls(pending)
        out = []
        for i, (name, args, whole) in enumerate(entries):
            fragment = self._extend(first + i, arguments_prefix(args, whole))
            if fragment:
                out.append(ArgumentsDelta(first + i, name, fragment))
        self.growing = self._watch(pending, entries, first)
        return out, len(entries)

    def finish(self, index: int, name: str, arguments: str) -> list[ArgumentsDelta]:
        """The last fragment of call `index`, now whole."""
        fragment = self._extend(index, arguments)
        self.sent.pop(index, None)
        return [ArgumentsDelta(index, name, fragment)] if fragment else []

    def _extend(self, index: int, text: str) -> str:
        """What `text` (a sure prefix of call `index`'s arguments) adds to what was told."""
        pieces = self.sent.setdefault(index, [])
        told = "".join(pieces)
        pieces[:] = [told] if told else []
        if len(text) <= len(told) or not text.startswith(told):
            return ""
        pieces.append(text[len(told):])
        return pieces[-1]

    def _watch(self, pending: str, entries: list, first: int) -> GrowingString | None:
        """A GrowingString when `pending` ends inside the last call's last string value.
        Not right after an escape's start or a lone surrogate: their decoding waits."""
        if not entries or entries[-1][2] or "\\" in pending[-6:]:
            return None
        leaf = last_string(entries[-1][1])
        if leaf is None or (leaf and 0xD800 <= ord(leaf[-1]) <= 0xDFFF):
            return None
        probe = self.read_calls(pending + SENTINEL)
        if len(probe) != len(entries) or last_string(probe[-1][1]) != leaf + SENTINEL:
            return None
        return GrowingString(first + len(entries) - 1, entries[-1][0], len(pending), leaf[-1:])
