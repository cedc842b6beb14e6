"""The xgrammar backend (the default): compiled grammars, matchers and batch operations.

The tokenizer's special tokens (its added tokens marked special: <|im_start|>, <|endoftext|>,
...) enter xgrammar's vocabulary as empty strings, which xgrammar treats as special tokens
and never allows inside a grammar: read literally, "<|im_start|>" would be legal text inside
a JSON string. The stop tokens stay allowed where the grammar is complete. xgrammar knows the
tokenizer's ids only; the ids of wider logits are the sampler's concern (`GrammarVocab`).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from slipstream.sampling.grammar.vocab import GrammarVocab
from slipstream.sampling.structured import GrammarKey

__all__ = ["XGrammarBackend", "XGrammarMatcher"]

# xgrammar's C++ errors start with a time and a source location, checks with their condition.
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_FAILED_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")
_MAX_MESSAGE = 300

# Every JSON object, and only objects: a schema with no declared properties, not strict.
_ANY_OBJECT_SCHEMA = '{"type":"object"}'

_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice",
         "json_object": "JSON object grammar", "structural_tag": "structural tag"}


def _error_message(error: BaseException) -> str:
    """The first line of a backend error, without its source location."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = _FAILED_CHECK.sub("", _LOCATION.sub("", lines[0] if lines else type(error).__name__))
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 3] + "..."


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal (JSON escapes are EBNF escapes)."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


class XGrammarMatcher:
    """One request's xgrammar matcher (`BackendMatcher`), in the model's token ids."""

    __slots__ = ("backend", "matcher")

    def __init__(self, backend: XGrammarBackend, matcher: xgr.GrammarMatcher):
        self.backend = backend
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        token = self.backend.grammar_vocab.library_token(token_id)
        return token is not None and self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.backend.fill_bitmasks([self], bitmask, [row])

    def is_completed(self) -> bool:
        return self.matcher.is_completed()

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XGrammarBackend:
    """`GrammarBackend` over xgrammar.

    hf_tokenizer: a transformers fast tokenizer; vocab_size: the model's logits width;
    stop_token_ids: the model's EOS ids; compile_threads: xgrammar's threads for one compile
    (its token-mask precomputation); batch_threads: threads of a batch bitmask fill.
    """

    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *,
                 compile_threads: int | None = None, batch_threads: int | None = None):
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(sorted(int(i) for i in stop_token_ids))
        tokenizer_size = max(hf_tokenizer.get_vocab().values(), default=-1) + 1
        self.grammar_vocab = GrammarVocab.of(self.stop_token_ids, tokenizer_size, self.vocab_size,
                                             getattr(hf_tokenizer, "eos_token_id", None))
        self._narrow = torch.zeros((0, self.grammar_vocab.words), dtype=torch.int32)
        cores = os.cpu_count() or 1
        self.tokenizer_info = self._tokenizer_info(hf_tokenizer)
        # The compiler's own cache stays off: GrammarCompiler's LRU is the one cache, so its
        # size bounds memory and a cold compile is cold.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info,
                                            max_threads=compile_threads or min(8, cores),
                                            cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(batch_threads or max(1, cores // 2))

    def _tokenizer_info(self, hf_tokenizer: Any) -> xgr.TokenizerInfo:
        # xgrammar detects the vocabulary's encoding (byte-level, byte-fallback, raw); the
        # vocabulary itself is rebuilt with the special tokens emptied.
        size, stops = self.grammar_vocab.size, list(self.grammar_vocab.stops)
        detected = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=size, stop_token_ids=stops)
        special = set(getattr(hf_tokenizer, "all_special_ids", ()))
        special |= {i for i, token in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()
                    if getattr(token, "special", False)}
        encoded = [""] * size
        for token, token_id in hf_tokenizer.get_vocab().items():
            if token_id < size and token_id not in special:
                encoded[token_id] = token
        return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=size, stop_token_ids=stops,
                                 add_prefix_space=detected.add_prefix_space)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, spec, fixed_whitespace = key
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(spec, any_whitespace=not fixed_whitespace)
            if kind == "json_object":
                return self.compiler.compile_json_schema(
                    _ANY_OBJECT_SCHEMA, any_whitespace=not fixed_whitespace, strict_mode=False)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                # GBNF rules are written `name ::= ...`; anything else is read as Lark.
                if "::=" in spec:
                    return self.compiler.compile_grammar(spec)
                return self.compiler.compile_lark(spec)
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(spec)
        except Exception as e:  # xgrammar raises RuntimeError and its own error types
            what = _WHAT.get(kind) or ("EBNF grammar" if "::=" in spec else "Lark grammar")
            raise ValueError(f"invalid {what}: {_error_message(e)}") from None
        raise ValueError(f"unknown structured output kind {kind!r}")

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(self, xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: Sequence[XGrammarMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        handles = [m.matcher for m in matchers]
        if self.grammar_vocab.direct:
            self.batch.batch_fill_next_token_bitmask(handles, bitmask, list(rows))
            return
        # xgrammar writes rows of its own width and ignores a view's row stride: a contiguous
        # scratch of the tokenizer's width, widened into the sampler's rows
        if self._narrow.shape[0] < len(rows):
            self._narrow = torch.zeros((len(rows), self.grammar_vocab.words), dtype=torch.int32)
        narrow = self._narrow[:len(rows)]
        self.batch.batch_fill_next_token_bitmask(handles, narrow, list(range(len(rows))))
        self.grammar_vocab.widen(narrow, bitmask, rows)

    def accept_tokens(self, matchers: Sequence[XGrammarMatcher],
                      token_ids: Sequence[int]) -> list[bool]:
        vocab = self.grammar_vocab
        tokens = [vocab.library_token(t) for t in token_ids]
        if all(t is not None for t in tokens):
            return self.batch.batch_accept_token([m.matcher for m in matchers], tokens)
        return [t is not None and m.matcher.accept_token(t) for m, t in zip(matchers, tokens)]
