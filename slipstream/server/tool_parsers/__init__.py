"""Tool-call parsers by family name (--tool-call-parser); one file per family."""
from __future__ import annotations

from slipstream.server.tool_parsers.base import (ExtractedToolCalls, StreamDelta, ToolCall,
                                                 ToolCallStream, ToolParser)
from slipstream.server.tool_parsers.hermes import HermesToolParser
from slipstream.server.tool_parsers.llama3_json import Llama3JsonToolParser
from slipstream.server.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser of family `name`; ValueError names the families there are."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "get_tool_parser", "ExtractedToolCalls", "StreamDelta", "ToolCall",
           "ToolCallStream", "ToolParser"]
