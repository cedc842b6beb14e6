"""Drawing a sampling drafter's tokens (draft model, EAGLE-3) so that `rejection_sample`'s rule
holds: the draft token x_j ~ q_j with noise of its own, independent of the target's draws.

    sample_drafts(draft_logits [R, V], greedy [R], seed [R], token_index [R])
        -> (tokens int32 [R], probs float32 [R, V])

`draft_logits` is the draft's distribution for the token at output index token_index, in the
same processed form as the target's (`sampling.sampler.processed_logits` with the request's
temperature and cuts, so q covers only tokens p can keep). The draw is Gumbel-max with the
counter-based noise keyed by `draft_seed(seed)` (never the target's G(seed, ...)); `probs` is
softmax(draft_logits), the q that `rejection_sample` takes as draft_probs. Greedy rows draft
the argmax (their probs: a point mass on it; their acceptance ignores q). Graph-safe.
"""
from __future__ import annotations

import torch

from slipstream.spec.rejection import draft_seed, draw_tokens


def sample_drafts(draft_logits: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor,
                  token_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = draft_logits.float()
    tokens = draw_tokens(logits, greedy, draft_seed(seed), token_index)
    probs = torch.softmax(logits, dim=-1)
    point = torch.zeros_like(probs).scatter_(1, tokens.long()[:, None], 1.0)
    return tokens, torch.where(greedy[:, None], point, probs)
