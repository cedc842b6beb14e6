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

from slipstream.sampling.grammar.vocab import GrammarVocab

__all__ = ["llguidance_tokenizer"]


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
