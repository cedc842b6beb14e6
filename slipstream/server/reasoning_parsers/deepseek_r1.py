"""DeepSeek-R1: the chat template ends the prompt with `<think>\\n`, so the output starts
inside the thinking and only `</think>` appears."""
from __future__ import annotations

from slipstream.server.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
