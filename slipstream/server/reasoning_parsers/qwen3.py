"""Qwen3: the model writes both tags, `<think>...</think>` then the answer; with
`chat_template_kwargs={"enable_thinking": false}` the template writes an empty think block
into the prompt and the output is all answer."""
from __future__ import annotations

from slipstream.server.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False
