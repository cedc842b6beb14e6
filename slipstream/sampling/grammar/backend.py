"""What a grammar backend provides, and the table of backends by name.

A backend is built once per model from its tokenizer and its vocabulary size (the logits'
width, which may exceed the tokenizer's vocabulary: those padded ids are never allowed). It
compiles a `GrammarKey` (the canonical form of a request's StructuredOutputsParams) into an
opaque compiled grammar, makes a matcher per request from one, and fills or advances many
matchers at once. Compile errors are a one-line `ValueError` naming the problem.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from slipstream.sampling.structured import GrammarKey

__all__ = ["GRAMMAR_BACKENDS", "BackendMatcher", "GrammarBackend", "create_grammar_backend"]


class BackendMatcher(Protocol):
    """A backend's matcher state for one request."""

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def is_completed(self) -> bool: ...

    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int                  # the logits' width, the bitmask's bit count
    stop_token_ids: tuple[int, ...]  # allowed once the grammar is complete

    def compile(self, key: GrammarKey) -> Any: ...

    def new_matcher(self, compiled: Any) -> BackendMatcher: ...

    def fill_bitmasks(self, matchers: Sequence[BackendMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None: ...

    def accept_tokens(self, matchers: Sequence[BackendMatcher],
                      token_ids: Sequence[int]) -> list[bool]: ...


#: name -> "module:class"; a backend's module loads only when it is asked for.
GRAMMAR_BACKENDS = {
    "xgrammar": "slipstream.sampling.grammar.xgrammar_backend:XGrammarBackend",
    "llguidance": "slipstream.sampling.grammar.llguidance_backend:LLGuidanceBackend",
}


def create_grammar_backend(name: str, hf_tokenizer: Any, vocab_size: int,
                           stop_token_ids: Sequence[int], *,
                           batch_threads: int | None = None) -> GrammarBackend:
    """The backend `name` for a transformers fast tokenizer and the model's vocabulary size;
    batch_threads: the threads of its batch bitmask fills (None: the backend's default)."""
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; known: {', '.join(GRAMMAR_BACKENDS)}")
    module, _, cls = GRAMMAR_BACKENDS[name].partition(":")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as e:  # an optional library (llguidance) not installed
        raise ValueError(f"the {name} backend needs the {e.name} package: pip install {e.name}") from None
    return getattr(loaded, cls)(hf_tokenizer, vocab_size, stop_token_ids, batch_threads=batch_threads)
