"""Reasoning parsers (`--reasoning-parser NAME`): each splits a thinking model's output into
`reasoning_content` and `content`; one small file per model family, the shared state machine
in base.py, the grammar that keeps the thinking free under a structured output in grammar.py."""
from __future__ import annotations

from slipstream.server.reasoning_parsers.base import ReasoningParser, ReasoningSplit, ReasoningSplitter
from slipstream.server.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from slipstream.server.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser registered as `name` (None: none); ValueError lists the known names."""
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ReasoningSplitter",
           "get_reasoning_parser"]
