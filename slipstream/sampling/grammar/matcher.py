"""`GrammarMatcher`: one request's position in its grammar.

The runner's use, per step: once batch N's tokens are known, each constrained request
accepts its new tokens (`accept_tokens` for the batch); then `fill_bitmasks` writes the rows
of batch N+1 into the pinned bitmask that the h2d stream copies. Rollback undoes accepted
tokens (preemption, rejected speculative drafts). The stop tokens are allowed only where the
grammar is complete; after one is accepted the matcher is terminated and its row allows only
the stop tokens (a terminated row is never sampled for real, but its logits stay finite).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from slipstream.sampling.grammar.backend import BackendMatcher, GrammarBackend
from slipstream.sampling.grammar.bitmask import fill_only_allowed

__all__ = ["GrammarMatcher", "accept_tokens", "fill_bitmasks"]


class GrammarMatcher:
    """Follows one request's generated tokens through its compiled grammar."""

    __slots__ = ("backend", "num_accepted", "state")

    def __init__(self, backend: GrammarBackend, compiled: Any):
        self.backend = backend
        self.state: BackendMatcher = backend.new_matcher(compiled)
        self.num_accepted = 0  # tokens accepted and not rolled back

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id` if the grammar allows it; False (state unchanged) if not."""
        if not 0 <= token_id < self.backend.vocab_size:
            return False
        accepted = self.state.accept_token(token_id)
        self.num_accepted += accepted
        return accepted

    def accept_many(self, token_ids: Iterable[int]) -> int:
        """Accepts tokens in order up to the first one the grammar rejects; returns how many
        were accepted (len(token_ids) when all were)."""
        count = 0
        for token_id in token_ids:
            if not self.accept(token_id):
                break
            count += 1
        return count

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (a stop token included)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback takes 0 to {self.num_accepted} tokens (those accepted), "
                             f"got {num_tokens}")
        if num_tokens:
            self.state.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row `row` of a CPU int32 bitmask."""
        if self.state.is_terminated():
            fill_only_allowed(bitmask, row, self.backend.stop_token_ids)
        else:
            self.state.fill_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the request's output is complete."""
        return self.state.is_terminated()

    @property
    def accepts_eos(self) -> bool:
        """The output so far is a complete sentence of the grammar: a stop token may come next."""
        return not self.state.is_terminated() and self.state.is_completed()


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                  rows: Sequence[int]) -> None:
    """`matchers[i].fill_bitmask(bitmask, rows[i])` for every i, the live ones in one backend
    call (which spreads them over its threads)."""
    if len(matchers) != len(rows):
        raise ValueError(f"fill_bitmasks needs one row per matcher, got {len(matchers)} "
                         f"matchers and {len(rows)} rows")
    live, live_rows = [], []
    for matcher, row in zip(matchers, rows):
        if matcher.is_terminated:
            matcher.fill_bitmask(bitmask, row)
        else:
            live.append(matcher.state)
            live_rows.append(row)
    if live:
        matchers[0].backend.fill_bitmasks(live, bitmask, live_rows)


def accept_tokens(matchers: Sequence[GrammarMatcher], token_ids: Sequence[int]) -> list[bool]:
    """`matchers[i].accept(token_ids[i])` for every i, in one backend call."""
    if len(matchers) != len(token_ids):
        raise ValueError(f"accept_tokens needs one token per matcher, got {len(matchers)} "
                         f"matchers and {len(token_ids)} tokens")
    if not matchers:
        return []
    backend = matchers[0].backend
    # an id past the vocabulary is rejected here, the others go to the backend at once
    valid = [i for i, t in enumerate(token_ids) if 0 <= t < backend.vocab_size]
    result = [False] * len(matchers)
    if valid:
        accepted = backend.accept_tokens([matchers[i].state for i in valid],
                                         [token_ids[i] for i in valid])
        for i, ok in zip(valid, accepted):
            matchers[i].num_accepted += ok
            result[i] = bool(ok)
    return result
