"""A grammar library's vocabulary inside the model's logits (`GrammarVocab`).

The model's logits are often wider than its tokenizer (Qwen: 151936 logits, 151665 tokens;
under dummy weights the bench pairs a Qwen-shaped model with SmolLM2's 49152 tokens). The ids
past the tokenizer are no text and never allowed, so the library is given the tokenizer's ids
only: xgrammar spends time on every padded id (an empty token) in each fill and accept, 20x
at 49152 tokens padded to 151936 (a fill inside a JSON string 11 -> 235 us, an accept 2.7 ->
40 us on one core). The bitmask the sampler reads stays as wide as the logits: `widen` copies
the library's rows into it and keeps the padded ids' bits at zero.

A stop id past the tokenizer (it may be any id below the logits width) cannot be one of the
library's stop ids. The library's stop ids are then those inside the tokenizer or, where there
are none, one stand-in: the tokenizer's own EOS (a special token, so no grammar text matches
it). A stop id past the tokenizer is allowed in a row exactly where the library allows its
stop ids (the grammar is complete) and is accepted as the library's stop; the stand-in, not a
stop of the model, is never allowed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from slipstream.sampling.grammar.bitmask import bitmask_width

__all__ = ["GrammarVocab"]


@dataclass(frozen=True)
class GrammarVocab:
    vocab_size: int               # the logits' width: the sampler's bitmask has its bits
    size: int                     # the library's ids, [0, size): the tokenizer's
    stops: tuple[int, ...]        # the library's stop ids: the model's inside it, or the stand-in
    past: tuple[int, ...]         # the model's stop ids at or past `size`
    stand_in: int | None          # the library's stop when no stop id of the model is inside

    @classmethod
    def of(cls, stop_token_ids: Sequence[int], tokenizer_size: int, vocab_size: int,
           tokenizer_eos: int | None) -> GrammarVocab:
        """The layout for a tokenizer of `tokenizer_size` ids (its EOS `tokenizer_eos`) under
        logits `vocab_size` wide; a one-line ValueError where the stop ids do not fit."""
        ids = sorted({int(i) for i in stop_token_ids})
        if not ids:
            raise ValueError("a grammar backend needs the model's stop token ids (EOS)")
        if ids[0] < 0 or ids[-1] >= vocab_size:
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise ValueError(f"stop token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
        size = min(int(tokenizer_size), int(vocab_size))
        inside = tuple(i for i in ids if i < size)
        past = tuple(i for i in ids if i >= size)
        if inside:
            return cls(int(vocab_size), size, inside, past, None)
        if tokenizer_eos is None or not 0 <= tokenizer_eos < size:
            raise ValueError(f"the model's stop token ids {ids} all lie past its tokenizer's {size} "
                             f"tokens, and the tokenizer has no EOS token to stand for them")
        return cls(int(vocab_size), size, (int(tokenizer_eos),), past, int(tokenizer_eos))

    @property
    def direct(self) -> bool:
        """The library can write the sampler's bitmask itself (nothing to widen or patch)."""
        return bitmask_width(self.size) == bitmask_width(self.vocab_size) and not self.patches

    @property
    def words(self) -> int:
        """int32 words of one row of the library's own bitmask."""
        return bitmask_width(self.size)

    def library_token(self, token_id: int) -> int | None:
        """The id the library accepts for the model's `token_id`; None: never allowed."""
        if token_id == self.stand_in:
            return None
        if 0 <= token_id < self.size:
            return token_id
        if token_id in self.past:
            return self.stops[0]
        return None

    def widen(self, narrow: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Rows 0..len(rows)-1 of the library's bitmask `narrow` into rows `rows` of the
        sampler's `bitmask`: the padded ids' bits zero, the stop ids past the tokenizer set
        where the library allowed its stop, the stand-in's bit cleared."""
        n, w = len(rows), self.words
        out = bitmask.numpy()
        index = np.asarray(rows, dtype=np.int64)
        src = narrow[:n].numpy()
        out[index, :w] = src
        if out.shape[1] > w:
            out[index, w:] = 0
        if not self.patches:
            return
        word, bit = divmod(self.stops[0], 32)
        stopping = ((src[:, word].view(np.uint32) >> np.uint32(bit)) & np.uint32(1)).astype(bool)
        self.patch_stops(bitmask, rows, stopping)

    @property
    def patches(self) -> bool:
        """Whether a filled row needs `patch_stops` (a stop id past the tokenizer, or a stand-in)."""
        return bool(self.past) or self.stand_in is not None

    def patch_stops(self, bitmask: torch.Tensor, rows: Sequence[int], stopping: Sequence[bool]) -> None:
        """In rows `rows` of the sampler's CPU `bitmask`: the stand-in's bit cleared, the stop ids
        past the tokenizer set in the rows where the grammar may stop (`stopping`, one a row)."""
        out = bitmask.numpy()
        index = np.asarray(rows, dtype=np.int64)
        if self.stand_in is not None:
            word, bit = divmod(self.stand_in, 32)
            out[index, word] &= ~_bit(bit)
        ending = index[np.asarray(stopping, dtype=bool)]
        if len(ending):
            for token_id in self.past:
                word, bit = divmod(token_id, 32)
                out[ending, word] |= _bit(bit)


def _bit(bit: int) -> np.int32:
    """An int32 with only `bit` set (bit 31 is the sign bit)."""
    return np.uint32(1 << bit).view(np.int32)
