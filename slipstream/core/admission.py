"""Whether a request can ever run on an engine.

The front ends run every check once, at their front door (`frontend.prompts.validate_request`):
the prompt's ids are ints inside the vocabulary (`vocabulary_error`, a pass over the prompt)
and the request fits the context and the KV cache (`fit_error`). The core repeats both (and
that the request's row fits the request table), so that nothing unplaceable or unstorable
reaches the scheduler, and it fails that request alone."""
from __future__ import annotations

from slipstream.core.messages import CoreInfo


def vocabulary_error(prompt_token_ids: list[int], vocab_size: int) -> str | None:
    if prompt_token_ids and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        return f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None


def fit_error(num_prompt_tokens: int, max_tokens: int, info: CoreInfo) -> str | None:
    """Empty, longer than the context, or more KV blocks than the whole cache has."""
    n = num_prompt_tokens
    if n == 0:
        return "the prompt is empty"
    if n + max_tokens > info.max_model_len:
        return (f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} tokens, "
                f"more than max_model_len={info.max_model_len}")
    blocks = -(-(n + max_tokens) // info.block_size)
    if blocks > info.num_kv_blocks:
        return (f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {blocks} KV blocks, "
                f"but the whole KV cache has {info.num_kv_blocks}")
    return None


def admission_error(prompt_token_ids: list[int], max_tokens: int, info: CoreInfo) -> str | None:
    """Every check of a request's prompt, in the order a caller reads them."""
    return vocabulary_error(prompt_token_ids, info.vocab_size) or fit_error(len(prompt_token_ids), max_tokens, info)


def as_token_ids(prompt) -> list[int]:
    """A prompt given as token ids, checked to be a list of ints (not bools)."""
    # (the distinct element types, not every element: 256 x 1,000-token prompts cost
    # ~0.1 s through a per-token isinstance loop)
    if isinstance(prompt, (list, tuple)) and all(issubclass(t, int) and t is not bool
                                                 for t in set(map(type, prompt))):
        return list(prompt)
    raise TypeError("a prompt must be a string or a list of token ids (ints), "
                    f"got {type(prompt).__name__}")
