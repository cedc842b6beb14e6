"""The front door: a request is validated here once, before anything reaches the core.

`validate_request` tokenizes the prompt, checks its ids (ints, inside the vocabulary), that
it fits the context and the KV cache with its max_tokens (`core.admission`, against the
numbers the engine reports in its `CoreInfo`), and takes SamplingParams that were built (and
so validated) once; it returns a `ValidatedRequest`, which the engine clients (`EngineClient`)
pass along without checking it again; the core keeps an O(1) guard of its own. Also here:
chat messages and their template."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from slipstream.core.admission import admission_error, as_token_ids
from slipstream.core.messages import CoreInfo
from slipstream.frontend.outputs import CompletionOutput, RequestMetrics, RequestOutput
from slipstream.model.tokenizer import ChatOptions, check_text
from slipstream.sampling.params import SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed `validate_request`: its prompt can run on the engine it was
    checked against, and its params are a validated SamplingParams."""
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestRejected(ValueError):
    """A request that can never run (empty, ids outside the vocabulary, too long, more KV
    blocks than the cache has); a one-line message, and what was known of the request, so a
    front end can end it as an output instead of raising."""

    def __init__(self, message: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                 params: SamplingParams | None = None) -> None:
        super().__init__(message)
        self.prompt, self.prompt_token_ids = prompt, list(prompt_token_ids or [])
        self.params = params if params is not None else SamplingParams()

    def output(self, request_id: str, arrival_time: float) -> RequestOutput:
        """The request's only output: finished, every completion with finish_reason "error"."""
        completions = [CompletionOutput(i, finish_reason="error") for i in range(self.params.n)]
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, completions, True, str(self),
                             metrics=RequestMetrics(arrival_time, finished_time=arrival_time))


def sampling_params_of(params) -> SamplingParams:
    """The request's SamplingParams (None: the defaults); TypeError for anything else."""
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        raise TypeError("sampling params must be a SamplingParams, got a dict: pass "
                        "SamplingParams(**d) or SamplingParams.from_dict(d)")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return params


def tokenize_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids); TypeError / ValueError for bad prompts."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights or no tokenizer files): "
                             "pass prompts as lists of token ids")
        return prompt, tokenizer.encode(check_text("prompt", prompt))
    return None, as_token_ids(prompt)


def validate_request(prompt, params: SamplingParams | None, tokenizer, info: CoreInfo) -> ValidatedRequest:
    """The front door. TypeError: not a prompt (or params not a SamplingParams); ValueError:
    a text prompt and no tokenizer; RequestRejected (a ValueError): it can never run here."""
    params = sampling_params_of(params)
    text, ids = tokenize_prompt(prompt, tokenizer)
    error = admission_error(ids, params.max_tokens, info)
    if error:
        raise RequestRejected(error, text, ids, params)
    return ValidatedRequest(text, ids, params)


async def admit_request(validate: Callable[[Any, SamplingParams], ValidatedRequest], prompt, sampling_params,
                        off_loop_chars: int) -> ValidatedRequest:
    """The ValidatedRequest of an engine client's `generate(prompt, sampling_params)`: `prompt`
    itself when it is one, else `validate(prompt, params)`, on a worker thread for a text
    longer than `off_loop_chars` (a long text takes milliseconds to seconds to tokenize, which
    on the event loop would stall every other stream). TypeError: params that are not a
    SamplingParams, or any beside a ValidatedRequest; RequestRejected: any problem of the
    prompt, for the caller to end the request with as an output."""
    if isinstance(prompt, ValidatedRequest):
        if sampling_params is not None:
            raise TypeError("a ValidatedRequest carries its sampling params; pass none beside it")
        return prompt
    params = sampling_params_of(sampling_params)
    try:
        if isinstance(prompt, str) and len(prompt) > off_loop_chars:
            return await asyncio.get_running_loop().run_in_executor(None, validate, prompt, params)
        return validate(prompt, params)
    except RequestRejected:
        raise
    except (TypeError, ValueError) as e:
        raise RequestRejected(str(e), params=params) from None


def normalize_messages(messages) -> list[dict]:
    """Chat messages as the template wants them: a list of {"role", "content": str, ...};
    content given as OpenAI text parts ([{"type": "text", "text": ...}]) is joined by
    newlines, as vLLM joins them; only an assistant message may have null content. Other
    keys of a message (e.g. "name") are kept. ValueError names the first bad message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if content is None and role != "assistant":
            raise ValueError(f"messages[{i}].content is missing")
        out.append(dict(m, content=_content_text(content, i)))
    return out


def _content_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(f"messages[{i}].content", content)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{i}].content[{j}]: only text parts "
                                 f"({{\"type\": \"text\", \"text\": ...}}) are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                got = "nothing" if part.get("text") is None else type(part["text"]).__name__
                raise ValueError(f"messages[{i}].content[{j}].text must be a string, got {got}")
            parts.append(check_text(f"messages[{i}].content[{j}].text", part["text"]))
        return "\n".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")


def chat_token_ids(messages, tokenizer, options: ChatOptions | None = None) -> list[int]:
    """The prompt of one conversation through the model's chat template (ValueError if the
    messages or options are bad, or the template refuses them)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template; this model has none")
    return tokenizer.apply_chat_template(normalize_messages(messages), options)
