"""The llguidance backend's vocabulary: its tokenizer over the model's logits width, and the
model's stop ids, including those past the tokenizer.

The model's logits are often wider than its tokenizer (Qwen: 151936 logits, 151665 tokens;
under dummy weights a bench pairs a Qwen-shaped model with SmolLM2's 49152 tokens), and a stop
id from generation_config may lie anywhere below the logits width. llguidance pads its
vocabulary to `n_vocab` with tokens it never allows (unlike xgrammar, at little cost: its
padded fill measured no slower than a narrow fill widened by `GrammarVocab.widen`), so it
writes the sampler's rows itself. But it checks its EOS ids against the tokenizer's own size,
so a stop id past the tokenizer cannot be one of them. The stop ids are laid out as for
xgrammar (`GrammarVocab`):

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
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from slipstream.sampling.grammar.vocab import GrammarVocab

__all__ = ["llguidance_tokenizer", "needs_patch", "patch_rows"]


def needs_patch(vocab: GrammarVocab) -> bool:
    """Whether llguidance's filled rows need `patch_rows` (only with a stop id past the tokenizer)."""
    return bool(vocab.past) or vocab.stand_in is not None


def patch_rows(vocab: GrammarVocab, bitmask: torch.Tensor, rows: Sequence[int],
               accepting: Sequence[bool]) -> None:
    """After llguidance filled `rows` of the CPU int32 `bitmask`: the stand-in's bit cleared,
    the stop ids past the tokenizer allowed in the rows whose matcher is accepting (`accepting`,
    one a row). numpy's indexing: a fifth of torch's cost at 256 rows (19 against ~100 us)."""
    out = bitmask.numpy()
    index = np.fromiter(rows, dtype=np.int64, count=len(rows))
    if vocab.stand_in is not None:
        word, bit = divmod(vocab.stand_in, 32)
        out[index, word] &= ~_bit(bit)
    stopping = index[np.fromiter(accepting, dtype=bool, count=len(index))]
    if len(stopping):
        for token_id in vocab.past:
            word, bit = divmod(token_id, 32)
            out[stopping, word] |= _bit(bit)


def _bit(bit: int) -> np.int32:
    """An int32 with only `bit` set (bit 31 is the sign bit)."""
    return np.uint32(1 << bit).view(np.int32)


def llguidance_tokenizer(hf_tokenizer: Any, vocab_size: int,
                         stop_token_ids: Sequence[int]) -> tuple[llguidance.LLTokenizer, GrammarVocab]:
    """llguidance's tokenizer of a transformers fast tokenizer, padded to the model's logits
    width `vocab_size` (llguidance never allows the padding), and the stop ids' layout; a
    one-line ValueError where they do not fit."""
    # llguidance's own count of the tokenizer, which its EOS ids must be under (added tokens too)
    size = hf_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size < size:
        raise ValueError(f"the model's vocabulary ({vocab_size}) is narrower than its tokenizer's "
                         f"({size} tokens)")
    vocab = GrammarVocab.of(stop_token_ids, size, vocab_size, hf_tokenizer.eos_token_id)
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(vocab.stops))
    if vocab.stand_in is not None and not tokenizer.is_special_token(vocab.stand_in):
        raise ValueError(f"the model's stop token ids {list(vocab.past)} all lie past its tokenizer, "
                         f"and its EOS {vocab.stand_in} is not a special token to stand for them")
    return tokenizer, vocab
