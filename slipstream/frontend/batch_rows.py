"""The rows of a batch job, in and out, for `generate --input` with or without `--ray`.

Rows follow `ray.data.llm`'s conventions.  In: one of `prompt` (text), `prompt_token_ids`
(ints) or `messages` (a chat; content a string or OpenAI text parts), an optional `id`,
optional `sampling_params` (an object over the job's defaults) and, for a chat,
`chat_template_kwargs` (over the job's, key by key), `add_generation_prompt` and
`continue_final_message`.  A sampling field may also sit at the top level, as older JSONL
files have it: it joins `sampling_params`, and one given in both places is an error.  A
null anywhere means "not given" (Ray Data fills the columns a row lacks with nulls).
Structured outputs: `structured_outputs` (a sampling field, StructuredOutputsParams' fields)
or OpenAI's `response_format` (json_schema, json_object; text constrains nothing), not both.
Out: `RowResult`'s fields, `ray.data.llm`'s names plus `finish_reason` and `error`.

Errors are ValueErrors of one line naming the field; the caller adds where the row is.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from slipstream.frontend.prompts import chat_token_ids, normalize_messages
from slipstream.model.tokenizer import ChatOptions
from slipstream.sampling.params import SamplingParams
from slipstream.sampling.structured import StructuredOutputsParams

INPUT_KEYS = ("prompt", "prompt_token_ids", "messages")
CHAT_KEYS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message", "tools")
ROW_KEYS = ("id", *INPUT_KEYS, "sampling_params", "response_format", *CHAT_KEYS)
SAMPLING_KEYS = SamplingParams.field_names()


@dataclass(frozen=True)
class RowDefaults:
    """What a row does not say: the job's sampling fields and chat options."""
    sampling: dict[str, Any] = field(default_factory=dict)
    chat: ChatOptions = field(default_factory=ChatOptions)
    text_as_chat: bool = False  # a `prompt` text is one user message (generate --chat)


@dataclass(frozen=True)
class BatchRow:
    """One parsed input row: what the engine is asked to do."""
    id: str | None
    prompt: str | list[int] | list[dict]  # text, token ids, or normalized chat messages
    is_chat: bool
    chat: ChatOptions | None  # the chat's options over the job's; None for a plain prompt
    params: SamplingParams

    def engine_prompt(self, tokenizer) -> str | list[int]:
        """The prompt to queue: a chat rendered to token ids through the template."""
        return chat_token_ids(self.prompt, tokenizer, self.chat) if self.is_chat else self.prompt


@dataclass
class RowResult:
    """The output columns of a row, for both paths (the order is the columns' order)."""
    generated_text: str | None = None
    generated_tokens: list[int] | None = None
    num_input_tokens: int = 0
    num_generated_tokens: int = 0
    time_taken_llm: float | None = None  # seconds from queueing the request to its end
    finish_reason: str = "error"  # stop | length | abort | error
    error: str | None = None


OUTPUT_COLUMNS = tuple(f.name for f in fields(RowResult))


def row_keys(keys) -> list[str]:
    """The keys among `keys` that belong to a row's request (Ray: the columns to read)."""
    return [k for k in keys if k in ROW_KEYS or k in SAMPLING_KEYS]


def row_id(obj: Mapping[str, Any]) -> str | None:
    """The row's `id` as a string (None: not given); ValueError for anything but a string or
    an integer, which a result line could not give back as the user wrote it."""
    rid = obj.get("id")
    if rid is None or isinstance(rid, str):
        return rid
    if isinstance(rid, numbers.Integral) and not isinstance(rid, bool):  # (Ray Data: numpy ints)
        return str(int(rid))
    raise ValueError(f"id must be a string or an integer, got {type(rid).__name__}")


def parse_row(obj: Mapping[str, Any], defaults: RowDefaults) -> BatchRow:
    """The request of one row; ValueError naming the bad field."""
    unknown = [str(k) for k in obj if k not in ROW_KEYS and k not in SAMPLING_KEYS]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (a row has {', '.join(ROW_KEYS)} "
                         f"and sampling fields)")
    rid = row_id(obj)
    given = {k: v for k, v in obj.items() if v is not None}
    inputs = [k for k in INPUT_KEYS if k in given]
    if len(inputs) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
    key = inputs[0]
    is_chat = key == "messages" or (defaults.text_as_chat and key == "prompt")
    prompt = _checked_prompt(key, given[key], is_chat)
    chat = _chat_options({k: given[k] for k in CHAT_KEYS if k in given}, defaults.chat, is_chat)
    sampling = _sampling_fields(given)
    if "response_format" in given:
        constraint = StructuredOutputsParams.from_response_format(given["response_format"])
        if constraint is not None:
            if "structured_outputs" in sampling:
                raise ValueError("give one of response_format and structured_outputs, not both")
            sampling["structured_outputs"] = constraint
    params = SamplingParams.from_dict({**defaults.sampling, **sampling})
    return BatchRow(rid, prompt, is_chat, chat, params)


def _checked_prompt(key: str, value, is_chat: bool):
    if key == "prompt_token_ids":
        if not (isinstance(value, list) and value
                and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        return value
    if key == "prompt" and not isinstance(value, str):
        raise ValueError("prompt must be a string (token ids go in prompt_token_ids)")
    if is_chat:
        return normalize_messages([{"role": "user", "content": value}] if isinstance(value, str) else value)
    return value


def _chat_options(own: dict, defaults: ChatOptions, is_chat: bool) -> ChatOptions | None:
    """A row's chat options over the job's."""
    if not is_chat:
        if own:
            raise ValueError(f"{', '.join(own)} apply to chats only (messages, or --chat)")
        return None
    kwargs = own.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    for k in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(own.get(k, False), bool):
            raise ValueError(f"{k} must be true or false")
    tools = own.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    return ChatOptions(own.get("add_generation_prompt", True), own.get("continue_final_message", False),
                       {k: v for k, v in kwargs.items() if v is not None},
                       tools=tools or None).over(defaults)


def _sampling_fields(given: dict) -> dict:
    """`sampling_params` with the top-level sampling fields merged in (nulls dropped)."""
    nested = given.get("sampling_params", {})
    if not isinstance(nested, Mapping):
        raise ValueError(f"sampling_params must be an object, got {type(nested).__name__}")
    nested = {k: v for k, v in nested.items() if v is not None}
    flat = {k: v for k, v in given.items() if k in SAMPLING_KEYS}
    both = [k for k in flat if k in nested]
    if both:
        raise ValueError(f"{both[0]} is given both at the top level and in sampling_params; give it once")
    return {**nested, **flat}


def result_of(out) -> RowResult:
    """The row result of a finished RequestOutput."""
    metrics = out.metrics
    taken = None
    if metrics is not None and metrics.finished_time is not None:
        taken = metrics.finished_time - metrics.arrival_time
    tokens = list(out.token_ids or ())  # None on a request that ended before generating
    return RowResult(generated_text=out.text, generated_tokens=tokens,
                     num_input_tokens=len(out.prompt_token_ids or ()),
                     num_generated_tokens=len(tokens), time_taken_llm=taken,
                     finish_reason="error" if out.error else (out.finish_reason or "abort"),
                     error=out.error or None)
