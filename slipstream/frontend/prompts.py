"""Prompts in, token ids out: tokenization, chat messages, and the admission check, done
in the front end before anything reaches the core (so a bad prompt of a list is rejected
before any prompt of the call is queued)."""
from __future__ import annotations

from slipstream.core.admission import admission_error, as_token_ids
from slipstream.core.messages import CoreInfo
from slipstream.sampling.params import SamplingParams
from slipstream.model.tokenizer import ChatOptions

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def tokenize_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids); TypeError / ValueError for bad prompts."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights or no tokenizer files): "
                             "pass prompts as lists of token ids")
        return prompt, tokenizer.encode(prompt)
    return None, as_token_ids(prompt)


def check_admission(token_ids: list[int], params: SamplingParams, info: CoreInfo) -> str | None:
    return admission_error(token_ids, params.max_tokens, info)


def validated_token_ids(prompt, params: SamplingParams | None, tokenizer, info: CoreInfo) -> list[int]:
    """The prompt's token ids; ValueError with a one-line message if it cannot run."""
    try:
        _, ids = tokenize_prompt(prompt, tokenizer)
    except TypeError as e:
        raise ValueError(str(e)) from None
    error = check_admission(ids, params or SamplingParams(), info)
    if error:
        raise ValueError(error)
    return ids


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
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{i}].content[{j}]: only text parts "
                                 f"({{\"type\": \"text\", \"text\": ...}}) are supported, got {kind!r}")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")


def chat_token_ids(messages, tokenizer, options: ChatOptions | None = None) -> list[int]:
    """The prompt of one conversation through the model's chat template (ValueError if the
    messages or options are bad, or the template refuses them)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template; this model has none")
    return tokenizer.apply_chat_template(normalize_messages(messages), options)
