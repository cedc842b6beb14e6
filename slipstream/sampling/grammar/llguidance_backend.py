"""The llguidance backend (`--structured-outputs-backend llguidance`): compiled grammars,
matchers and batch bitmask fills over llguidance (PyPI `llguidance`).

llguidance compiles a grammar when a matcher is made from it; a compile here makes one such
matcher, checks it, and keeps it as the template each request's matcher is a deep copy of
(microseconds), so the per-request cost stays off the step loop as with xgrammar.

Stop tokens: llguidance allows the EOS tokens where the grammar is complete but never
consumes them (it reports the grammar stopped); the matcher here records a stop token it
accepts, so `is_terminated` means what it means for xgrammar: a stop token was accepted.
Special tokens never match grammar text (llguidance's lexer reads them as non-text bytes).
The vocabulary is the model's logits width, and stop ids past the tokenizer are allowed where
the grammar is complete: llguidance_vocab.py says how.
Structural tags are xgrammar's format: this backend refuses them with one line.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from slipstream.sampling.grammar.llguidance_vocab import llguidance_tokenizer
from slipstream.sampling.structured import GrammarKey

__all__ = ["LLGuidanceBackend", "LLGuidanceMatcher"]

_MAX_MESSAGE = 300
_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice"}


def _one_line(text: str) -> str:
    """llguidance's error as one line: its first line, and the regex parser's "error: ..." line
    where there is one (the first says only where)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    line = (lines[0] if lines else "unknown error") + (f" {detail}" if detail else "")
    return line if len(line) <= _MAX_MESSAGE else line[:_MAX_MESSAGE - 3] + "..."


def strict_schema(schema: Any) -> Any:
    """`schema` with every object schema that does not say otherwise closed to properties it
    does not declare (additionalProperties false), as xgrammar's strict mode reads a schema, so
    both backends allow the same documents.  A copy; the input is left as it is."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def choice_lark(choices: Sequence[str]) -> str:
    """A Lark grammar whose sentences are exactly `choices` (JSON string escapes are Lark's)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class LLGuidanceMatcher:
    """One request's llguidance matcher (`BackendMatcher`); `num_tokens` counts the tokens
    accepted, a stop token included, `stopped_at` where the stop token is (None: none yet)."""

    __slots__ = ("backend", "matcher", "num_tokens", "stopped_at")

    def __init__(self, backend: LLGuidanceBackend, matcher: llguidance.LLMatcher):
        self.backend = backend
        self.matcher = matcher
        self.num_tokens = 0
        self.stopped_at: int | None = None

    def accept_token(self, token_id: int) -> bool:
        if self.stopped_at is not None or token_id == self.backend.grammar_vocab.stand_in:
            return False
        if token_id in self.backend.stops and self.matcher.is_accepting():
            self.num_tokens += 1
            self.stopped_at = self.num_tokens
            return True
        # try_consume_tokens leaves the state as it was when it rejects the token
        # (consume_token would put the matcher in its error state for good)
        if self.matcher.try_consume_tokens([token_id]) != 1:
            return False
        self.num_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self.stopped_at is not None:  # the stop token was never fed to llguidance
            self.stopped_at = None
            self.num_tokens -= 1
            num_tokens -= 1
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.backend.fill_bitmasks([self], bitmask, [row])

    def is_completed(self) -> bool:
        return self.matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self.stopped_at is not None


class LLGuidanceBackend:
    """`GrammarBackend` over llguidance.

    hf_tokenizer: a transformers fast tokenizer; vocab_size: the model's logits width (ids past
    the tokenizer's are never allowed); stop_token_ids: the model's EOS ids, anywhere below
    vocab_size (llguidance_vocab.py); batch_threads: threads of a batch bitmask fill."""

    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *,
                 batch_threads: int | None = None):
        self.vocab_size = int(vocab_size)
        self.tokenizer, self.grammar_vocab = llguidance_tokenizer(hf_tokenizer, self.vocab_size, stop_token_ids)
        self.stop_token_ids = tuple(sorted({int(i) for i in stop_token_ids}))
        self.stops = frozenset(self.stop_token_ids)
        self.executor = llguidance.LLExecutor(batch_threads or max(1, (os.cpu_count() or 1) // 2))

    def _grammar(self, kind: str, spec: str, fixed_whitespace: bool) -> str:
        """llguidance's grammar text of a constraint (not checked yet)."""
        M = llguidance.LLMatcher
        if kind in ("json", "json_object"):
            # json_object: any object (not strict, as xgrammar's any-object grammar)
            schema = strict_schema(json.loads(spec)) if kind == "json" else {"type": "object"}
            # fixed whitespace: one space after each separator, as xgrammar's
            options = ({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                       if fixed_whitespace else {"whitespace_flexible": True})
            return M.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return M.grammar_from_regex(spec)
        if kind == "choice":
            return M.grammar_from_lark(choice_lark(json.loads(spec)))
        # kind == "grammar": GBNF rules are written `name ::= ...`; anything else is read as Lark
        return M.grammar_from_lark(gbnf_to_lark(spec) if "::=" in spec else spec)

    def compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        kind, spec, fixed_whitespace = key
        if kind == "structural_tag":
            raise ValueError("the llguidance backend takes no structural tags (xgrammar's format); "
                             "use --structured-outputs-backend xgrammar")
        if kind not in _WHAT and kind != "grammar":
            raise ValueError(f"unknown structured output kind {kind!r}")
        what = _WHAT.get(kind) or ("EBNF grammar" if "::=" in spec else "Lark grammar")
        try:
            grammar = self._grammar(kind, spec, fixed_whitespace)
        except Exception as e:  # noqa: BLE001 - the GBNF translator raises bare Exceptions too
            raise ValueError(f"invalid {what}: {_one_line(e)}") from None
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid {what}: {_one_line(template.get_error())}")
        return template

    def new_matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self, compiled.deep_copy())

    def fill_bitmasks(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(m.matcher, row) for m, row in zip(matchers, rows)], bitmask)
        if self.grammar_vocab.patches:
            self.grammar_vocab.patch_stops(bitmask, rows, [m.matcher.is_accepting() for m in matchers])

    def accept_tokens(self, matchers: Sequence[LLGuidanceMatcher],
                      token_ids: Sequence[int]) -> list[bool]:
        return [m.accept_token(t) for m, t in zip(matchers, token_ids)]
