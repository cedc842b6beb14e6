"""What every reasoning parser shares: a streaming state machine that splits a model's output
into its thinking text (between the think tags) and its answer.

A parser is a `ReasoningParser` subclass naming its tags and whether the output starts
inside the thinking (the chat template already wrote the opening tag). `ReasoningSplitter`
takes the output's text in pieces of any size; the pieces it gives back add up to the same
split whichever way the text was cut, so a stream and a whole response agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@dataclass
class ReasoningSplit:
    """One piece of output: its thinking text and its answer text (either may be empty)."""
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: "ReasoningSplit") -> "ReasoningSplit":
        return ReasoningSplit(self.reasoning + other.reasoning, self.content + other.content)


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag cut by the piece's end)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """A model family's thinking markup. `starts_in_reasoning`: the template opened the
    thinking, so the output begins inside it and only the closing tag appears (an opening
    tag at the very start is still dropped); otherwise the output thinks only when it
    begins with the opening tag."""
    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    starts_in_reasoning: ClassVar[bool] = False

    def splitter(self) -> "ReasoningSplitter":
        return ReasoningSplitter(self)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output. reasoning is None when the output did
        not think; content is None when it thought and gave no answer (an unterminated
        think, e.g. max_tokens reached inside it)."""
        splitter = self.splitter()
        whole = splitter.feed(text) + splitter.finish()
        return splitter.result(whole)

    def reasoning_length(self, text: str) -> int:
        """How many characters at the start of a whole output are its thinking, its tags
        included (0: it did not think; all of them: it never left the thinking)."""
        splitter = self.splitter()
        whole = splitter.feed(text) + splitter.finish()
        return len(text) - len(whole.content) if splitter.thought else 0

    def reasoning_format(self) -> dict[str, Any]:
        """The xgrammar structural-tag format of the free thinking part that comes before a
        structured output's constraint (grammar.py)."""
        block = {"type": "tag", "begin": "", "content": {"type": "any_text"},
                 "end": self.end_tag}
        if self.starts_in_reasoning:
            # the thinking is already open: free text up to the closing tag, which may
            # itself repeat the opening tag at its start
            return block
        return {"type": "optional",
                "content": dict(block, begin=self.start_tag)}


class ReasoningSplitter:
    """The state machine of one output: at the start (an opening tag may come), inside the
    thinking (looking for the closing tag), in the answer. A tag cut between two pieces is
    held back until the next piece says whether it is one."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = _START
        self.pending = ""
        self.thought = False  # the output entered the thinking

    def feed(self, text: str) -> ReasoningSplit:
        out = ReasoningSplit()
        text = self.pending + text
        self.pending = ""
        p = self.parser
        if self.state == _START:
            if text.startswith(p.start_tag):
                text = text[len(p.start_tag):]
                self._enter_reasoning()
            elif p.start_tag.startswith(text):
                self.pending = text  # maybe the opening tag, not yet whole
                return out
            elif p.starts_in_reasoning:
                self._enter_reasoning()
            else:
                self.state = _CONTENT
        if self.state == _REASONING:
            at = text.find(p.end_tag)
            if at < 0:
                keep = _partial_tag_length(text, p.end_tag)
                out.reasoning = text[:len(text) - keep]
                self.pending = text[len(text) - keep:]
                return out
            out.reasoning = text[:at]
            text = text[at + len(p.end_tag):]
            self.state = _CONTENT
        out.content += text
        return out

    def _enter_reasoning(self) -> None:
        self.state = _REASONING
        self.thought = True

    def finish(self) -> ReasoningSplit:
        """What is held back when the output ends: a cut tag that never completed is text."""
        text, self.pending = self.pending, ""
        if self.state == _START and not self.parser.starts_in_reasoning:
            self.state = _CONTENT
            return ReasoningSplit(content=text)
        if self.state != _CONTENT:
            if self.state == _START:
                self._enter_reasoning()
            return ReasoningSplit(reasoning=text)
        return ReasoningSplit(content=text)

    def result(self, whole: ReasoningSplit) -> tuple[str | None, str | None]:
        """A whole output's split as the message's fields (see ReasoningParser.split)."""
        if not self.thought:
            return None, whole.content
        return whole.reasoning, whole.content or None
