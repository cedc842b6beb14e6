"""Rows in and out, as `ray.data.llm` has them.

In: `prompt` (text or token ids) or `messages` (a chat), optional `sampling_params` (a
mapping over the processor's defaults; a null field keeps the default) and, with messages,
optional `chat_template_kwargs` (over the processor's, key by key; null keys are dropped).  Out: the
columns of `OUTPUT_COLUMNS`; every other column of the row is passed through untouched.
A row that cannot run gets `finish_reason` "error" and its reason in `error`.
"""
from __future__ import annotations

from dataclasses import dataclass

from slipstream.frontend.prompts import chat_token_ids
from slipstream.sampling.params import SamplingParams
from slipstream.model.tokenizer import ChatOptions

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_input_tokens",
                  "num_generated_tokens", "finish_reason", "error")
INPUT_COLUMNS = ("prompt", "messages", "sampling_params", "chat_template_kwargs")


@dataclass
class RowResult:
    generated_text: str | None = None
    generated_token_ids: list[int] | None = None
    num_input_tokens: int = 0
    num_generated_tokens: int = 0
    finish_reason: str = "error"
    error: str | None = None


def row_prompt(row: dict, tokenizer, chat: ChatOptions | None = None):
    """The prompt of a row (text, token ids, or a chat rendered to token ids with the
    processor's chat options `chat`); ValueError naming what is wrong."""
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError("a row needs exactly one of 'prompt' and 'messages'")
    own = row.get("chat_template_kwargs")
    if own is not None and messages is None:
        raise ValueError("'chat_template_kwargs' applies to 'messages' rows only")
    if own is not None and not isinstance(own, dict):
        raise ValueError(f"'chat_template_kwargs' must be a mapping, got {type(own).__name__}")
    if messages is not None:
        options = ChatOptions(template_kwargs={k: v for k, v in (own or {}).items() if v is not None})
        return chat_token_ids(list(messages), tokenizer, options.over(chat or ChatOptions()))
    if not isinstance(prompt, (str, list)):
        raise ValueError(f"'prompt' must be text or a list of token ids, got {type(prompt).__name__}")
    return prompt


def row_params(row: dict, defaults: dict) -> SamplingParams:
    """The processor's sampling defaults overridden by the row's own (nulls dropped)."""
    own = row.get("sampling_params")
    if own is None:
        own = {}
    if not isinstance(own, dict):
        raise ValueError(f"'sampling_params' must be a mapping, got {type(own).__name__}")
    params = SamplingParams.from_dict({**defaults, **{k: v for k, v in own.items() if v is not None}})
    if params.n != 1:
        raise ValueError(f"sampling_params n must be 1 in a batch job (one output per row), got {params.n}")
    return params


def result_of(out) -> RowResult:
    """The row result of a finished RequestOutput."""
    error = out.error if out.error else None
    return RowResult(generated_text=out.text, generated_token_ids=list(out.token_ids),
                     num_input_tokens=len(out.prompt_token_ids or ()),
                     num_generated_tokens=len(out.token_ids),
                     finish_reason="error" if error else (out.finish_reason or "abort"),
                     error=error)


def check_defaults(sampling_params: dict | None) -> dict:
    """The processor's defaults, validated before any replica starts."""
    defaults = dict(sampling_params or {})
    SamplingParams.from_dict(defaults)
    if defaults.get("n", 1) != 1:
        raise ValueError("sampling_params n must be 1 in a batch job (one output row per input row)")
    return defaults
