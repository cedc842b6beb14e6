"""The llguidance backend's vocabulary: its tokenizer over the model's logits width, and the
model's stop ids, including those past the tokenizer.

The model's logits are often wider than its tokenizer (Qwen: 151936 logits, 151665 tokens;
under dummy weights a bench pairs a Qwen-shaped model with SmolLM2's 49152 tokens), and a stop
id from generation_config may lie anywhere below the logits width. llguidance pads its
vocabulary to `n_vocab` with tokens it never allows, but checks its EOS ids against the
tokenizer's own size, so a stop id past the tokenizer cannot be one of its EOS ids. Such ids
are handled here instead, outside llguidance:

- llguidance's EOS ids are the stop ids inside the tokenizer; where there are none, one
  stand-in: the tokenizer's own EOS (a special token, so no grammar text matches it). The
  stand-in is not a stop id of the model: its bit is cleared in every filled row and the
  matcher rejects it, so llguidance never sees it consumed.
- a stop id past the tokenizer is allowed in a row exactly where the matcher is accepting
  (the grammar is complete), which is where llguidance allows its own EOS ids, as xgrammar
  allows every stop id. The matcher accepts it without feeding it to llguidance (as every
  stop token: llguidance reports a stop rather than consuming one).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

__all__ = ["StopIds", "llguidance_tokenizer"]


@dataclass(frozen=True)
class StopIds:
    """The model's stop ids as the llguidance backend handles them (see the module's text)."""
    ids: frozenset[int]       # every stop id of the model: accepted where the grammar is complete
    eos: tuple[int, ...]      # llguidance's EOS ids: the stop ids inside the tokenizer, or the stand-in
    past: tuple[int, ...]     # stop ids past the tokenizer: set in a row where its matcher is accepting
    stand_in: int | None      # llguidance's EOS when no stop id is inside the tokenizer (never allowed)

    @property
    def patches_rows(self) -> bool:
        """Whether a filled row needs `patch_rows` (only when a stop id is past the tokenizer)."""
        return bool(self.past) or self.stand_in is not None

    def patch_rows(self, bitmask: torch.Tensor, rows: Sequence[int], accepting: Sequence[bool]) -> None:
        """After llguidance filled `rows` of the CPU int32 `bitmask`: the stand-in's bit
        cleared, the stop ids past the tokenizer allowed in the rows whose matcher is accepting
        (`accepting`, one a row). numpy's indexing: a third of torch's cost at 256 rows."""
        out = bitmask.numpy()
        index = np.fromiter(rows, dtype=np.int64, count=len(rows))
        if self.stand_in is not None:
            word, bit = divmod(self.stand_in, 32)
            out[index, word] &= ~_bit(bit)
        stopping = index[np.fromiter(accepting, dtype=bool, count=len(index))]
        if len(stopping):
            for token_id in self.past:
                word, bit = divmod(token_id, 32)
                out[stopping, word] |= _bit(bit)


def _bit(bit: int) -> np.int32:
    """An int32 with only `bit` set (bit 31 is the sign bit)."""
    return np.uint32(1 << bit).view(np.int32)


def stop_ids(stop_token_ids: Sequence[int], tokenizer_size: int, vocab_size: int,
             tokenizer_eos: int | None) -> StopIds:
    """How `stop_token_ids` reach llguidance, for a tokenizer of `tokenizer_size` tokens (its EOS
    `tokenizer_eos`) and logits `vocab_size` wide. ValueError where they cannot."""
    ids = sorted({int(i) for i in stop_token_ids})
    if not ids:
        raise ValueError("a grammar backend needs the model's stop token ids (EOS)")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise ValueError(f"stop token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    inside = tuple(i for i in ids if i < tokenizer_size)
    past = tuple(i for i in ids if i >= tokenizer_size)
    if inside:
        return StopIds(frozenset(ids), inside, past, None)
    if tokenizer_eos is None or not 0 <= tokenizer_eos < tokenizer_size:
        raise ValueError(f"the model's stop token ids {list(ids)} are all past the tokenizer's "
                         f"{tokenizer_size} tokens, and the tokenizer has no EOS token to stand for them")
    return StopIds(frozenset(ids), (int(tokenizer_eos),), past, int(tokenizer_eos))


def llguidance_tokenizer(hf_tokenizer: Any, vocab_size: int,
                         stop_token_ids: Sequence[int]) -> tuple[llguidance.LLTokenizer, StopIds]:
    """llguidance's tokenizer of a transformers fast tokenizer, padded to the model's logits
    width `vocab_size` (llguidance never allows the padding), and the model's stop ids."""
    # llguidance's own count of the tokenizer, which its EOS ids must be under (added tokens too)
    size = hf_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size < size:
        raise ValueError(f"the model's vocabulary ({vocab_size}) is narrower than its tokenizer's "
                         f"({size} tokens)")
    stops = stop_ids(stop_token_ids, size, vocab_size, hf_tokenizer.eos_token_id)
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(stops.eos))
    if stops.stand_in is not None and not tokenizer.is_special_token(stops.stand_in):
        raise ValueError(f"the model's stop token ids {sorted(stops.ids)} are all past the tokenizer, "
                         f"and its EOS {stops.stand_in} is not a special token to stand for them")
    return tokenizer, stops
