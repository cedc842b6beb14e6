"""The point-mass acceptance of a verification step and the bench's synthetic acceptance.

Point-mass drafts (n-gram, an all-greedy device drafter) are accepted while each equals the
target's own draw at its position, and the row emits the draw after them
(spec/rejection.py's rule for draft_probs None).  `emit_point_mass` applies that rule to the
sampler's draws at every position and writes what the rest of the step reads: each drafting
row's emitted tokens (-1 after them), their count, its drafts' count and its slot token (the
last emitted one).  On CUDA it is one Triton kernel (ops/triton_acceptance.py: a few dozen
small torch launches otherwise, each ~2 us inside a graph); the torch functions here are its
reference and the CPU path.

`slipstream bench --spec-synthetic-accept A` (a cost measurement with random weights) makes
every drafting row accept min(A, drafted) drafts whatever the target says.  A fractional A
(2.5: the 3.5 tokens a step of published EAGLE-3 figures) accepts floor(A) + 1 on that
fraction of a row's steps, picked by a counter-based hash of the row's seed and token index
(deterministic, the same in a graph, and independent of the steps' lengths, which themselves
follow the picks): the pick is `hash >> 8 < round(fraction * 2**24)`.
"""
from __future__ import annotations

import torch

from slipstream.sampling.noise import bits, row_keys

#: the hash lane of the synthetic acceptance's picks (outside every vocabulary and apart from
#: the acceptance uniforms' lane, spec/rejection.py)
SYNTHETIC_LANE = 0xFFFFFFFE


def synthetic_threshold(a: float) -> int:
    """The 24-bit bound of a fractional pick: floor(A) + 1 drafts where hash >> 8 is below it."""
    return round((a - int(a)) * (1 << 24))


def synthetic_accepted(num_drafts: torch.Tensor, seed: torch.Tensor, token_index: torch.Tensor,
                       a: float) -> torch.Tensor:
    """int64 [R]: how many drafts each row accepts under synthetic acceptance A (module doc)."""
    accepted = num_drafts.long().clamp(max=int(a))
    threshold = synthetic_threshold(a)
    if threshold:
        k1, k2 = row_keys(seed.long(), token_index.long())
        extra = (bits(torch.full_like(k1, SYNTHETIC_LANE), k1, k2) >> 8) < threshold
        accepted = torch.minimum(num_drafts.long(), accepted + extra.long())
    return accepted


def emitted(drafts: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor):
    """A row's emitted tokens [R, k + 1]: its first `accepted` drafts, then `token`, then -1;
    and their counts."""
    K1 = drafts.shape[1] + 1
    out = torch.cat([drafts.long(), torch.zeros_like(drafts[:, :1]).long()], dim=1)
    out = out.scatter(1, accepted[:, None], token.long()[:, None])
    pos = torch.arange(K1, device=drafts.device)[None, :]
    return torch.where(pos <= accepted[:, None], out, torch.full_like(out, -1)), accepted + 1


def accept_draws(drawn: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor):
    """Point-mass acceptance from the target's draws [R, k + 1] at every position: the
    drafts equal to the draws before them, then the draw after them; the emitted tokens
    (-1 after them) and their counts."""
    R, K1 = drawn.shape
    pos = torch.arange(K1, device=drawn.device)
    match = (drawn[:, :K1 - 1].long() == drafts.long()) & (pos[None, :K1 - 1] < num_drafts.long()[:, None])
    accepted = match.to(torch.int32).cumprod(dim=1).sum(dim=1)
    out = torch.where(pos[None, :] <= accepted[:, None], drawn.to(torch.int32), torch.full_like(drawn, -1, dtype=torch.int32))
    return out, accepted + 1


def synthetic_from_draws(drawn: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                         seed: torch.Tensor, token_index: torch.Tensor, a: float):
    """The synthetic outcome from the sampler's draws at every position [R, k + 1]: the
    accepted drafts, then the draw at the next position (the tokens are not the model's)."""
    accepted = synthetic_accepted(num_drafts, seed, token_index, a)
    return emitted(drafts, accepted, drawn.long().gather(1, accepted[:, None]).squeeze(1))


def synthetic_from_target(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                          greedy: torch.Tensor, seed: torch.Tensor, token_index: torch.Tensor, a: float):
    """The same outcome from the processed target [R, k + 1, V] (the rejection-sampling
    path's): the target's own draw at the next position."""
    from slipstream.spec.rejection import draw_tokens
    R, K1, V = target.shape
    accepted = synthetic_accepted(num_drafts, seed, token_index, a)
    at = target.gather(1, accepted[:, None, None].expand(R, 1, V)).squeeze(1)
    return emitted(drafts, accepted, draw_tokens(at.float(), greedy, seed, token_index.long() + accepted))


def write_emitted(out: torch.Tensor, num: torch.Tensor, num_drafts: torch.Tensor, rows: torch.Tensor,
                  tokens: torch.Tensor, num_emitted: torch.Tensor, drafted: torch.Tensor,
                  slot_tokens: torch.Tensor) -> None:
    """Rows `rows` of the step's outputs: the emitted tokens [R, k + 1], their counts, the
    drafts' counts, and the slot token (the last emitted one)."""
    out, num = out.to(torch.int32), num.to(torch.int32)
    tokens.index_copy_(0, rows, out)
    num_emitted.index_copy_(0, rows, num)
    drafted.index_copy_(0, rows, num_drafts.to(torch.int32))
    slot_tokens.index_copy_(0, rows, out.gather(1, (num.long() - 1)[:, None]).squeeze(1))


def emit_point_mass(drawn: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, rows: torch.Tensor,
                    seed: torch.Tensor, token_index: torch.Tensor, synthetic: float | None,
                    tokens: torch.Tensor, num_emitted: torch.Tensor, drafted: torch.Tensor,
                    slot_tokens: torch.Tensor, use_triton: bool | None = None) -> None:
    """The point-mass acceptance of R drafting rows (module doc) and its writes to rows
    `rows` of `tokens` int32 [S, k + 1], `num_emitted`, `drafted` and `slot_tokens` int32 [S].
    `drawn` [R, k + 1]: the sampler's draws; `seed`, `token_index` [S]: the sampling rows'
    (their token index is position 0's); `synthetic`: the bench's A, or None."""
    if use_triton is None:
        use_triton = drawn.is_cuda
    if use_triton:
        from slipstream.ops.triton_acceptance import emit_point_mass_triton
        emit_point_mass_triton(drawn, drafts, num_drafts, rows, seed, token_index,
                               None if synthetic is None else (int(synthetic), synthetic_threshold(synthetic)),
                               tokens, num_emitted, drafted, slot_tokens)
        return
    if synthetic is None:
        out, num = accept_draws(drawn, drafts, num_drafts)
    else:
        out, num = synthetic_from_draws(drawn, drafts, num_drafts, seed.index_select(0, rows),
                                        token_index.index_select(0, rows), synthetic)
    write_emitted(out, num, num_drafts, rows, tokens, num_emitted, drafted, slot_tokens)
