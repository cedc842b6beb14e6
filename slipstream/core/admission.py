"""Whether a request can ever run on an engine: one check, run by the front end before it
sends a request (so a call can reject a bad prompt before queuing any) and by the core
when the request arrives (so nothing unplaceable reaches the scheduler)."""
from __future__ import annotations

from slipstream.core.messages import CoreInfo


def admission_error(prompt_token_ids: list[int], max_tokens: int, info: CoreInfo) -> str | None:
    n, vocab = len(prompt_token_ids), info.vocab_size
    if n == 0:
        return "the prompt is empty"
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
        return f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
    if n + max_tokens > info.max_model_len:
        return (f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} tokens, "
                f"more than max_model_len={info.max_model_len}")
    blocks = -(-(n + max_tokens) // info.block_size)
    if blocks > info.num_kv_blocks:
        return (f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {blocks} KV blocks, "
                f"but the whole KV cache has {info.num_kv_blocks}")
    return None


def as_token_ids(prompt) -> list[int]:
    """A prompt given as token ids, checked to be a list of ints (not bools)."""
    # (the distinct element types, not every element: 256 x 1,000-token prompts cost
    # ~0.1 s through a per-token isinstance loop)
    if isinstance(prompt, (list, tuple)) and all(issubclass(t, int) and t is not bool
                                                 for t in set(map(type, prompt))):
        return list(prompt)
    raise TypeError("a prompt must be a string or a list of token ids (ints), "
                    f"got {type(prompt).__name__}")
