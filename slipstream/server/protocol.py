"""Request and response models of the OpenAI completions and chat APIs (pydantic v2).

Requests ignore unknown fields, as the OpenAI API and vLLM do. Types are checked here;
value ranges are checked where the request becomes `SamplingParams` (serving_common),
so a message names the field either way. Responses are built as models and dumped to JSON.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_NULL_MEANS_DEFAULT = ("n", "stream", "echo", "logprobs", "ignore_eos", "min_tokens",
                       "skip_special_tokens", "add_generation_prompt", "continue_final_message",
                       "include_stop_str_in_output")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        # clients send null for "not given"; only max_tokens gives null a meaning of its own
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in _NULL_MEANS_DEFAULT):
            data = {k: v for k, v in data.items() if not (v is None and k in _NULL_MEANS_DEFAULT)}
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat (OpenAI names, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[StrictStr] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # output constraints (structured_request.py): OpenAI's response_format, or vLLM's
    # structured_outputs, or its older guided_* fields; one of them per request
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM extras slipstream does not have: refused when set (UNSUPPORTED below)
    use_beam_search: bool = False
    length_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False


# those extras, each with its default, the value that means "not used": a request that sets
# one otherwise gets a 400 (serving_common.check_common) rather than an answer without it
UNSUPPORTED = {name: _SamplingFields.model_fields[name].default for name in (
    "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "priority", "prompt_logprobs",
    "return_tokens_as_token_ids")}

TokenIds = list[StrictInt]


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16  # null: up to the context length
    return_token_ids: bool = False  # each choice also carries its token ids (vLLM's extension)
    add_special_tokens: bool = True  # a text prompt gets the tokenizer's BOS (where it adds one)
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Request):
    type: str
    text: Any = None


class ChatMessage(_Request):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls (serving_tools.template_messages)
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatTemplateFields(_Request):
    """How the messages become a prompt (vLLM's extras; slipstream.model.tokenizer.ChatOptions)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused: the server's --chat-template sets it
    tools: list[Any] | None = None  # shown to the template; chat also parses the calls


class ChatCompletionRequest(_SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage]
    echo: bool = False  # the reply starts with the last message's content if it is the assistant's
    add_special_tokens: bool = False  # the template writes them; true: the tokenizer's too
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None  # None: true
    functions: Any = None  # the legacy form of tools: refused
    function_call: Any = None


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


# ---------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids, or from a model without a tokenizer


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[Any] = Field(default_factory=list)
    # with --reasoning-parser: the thinking, under both names vLLM sends
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
