"""Speculative sampling's acceptance: which of a row's k drafts the target keeps, and the
token it emits after them (Leviathan et al. 2023; Chen et al. 2023).

    rejection_sample(target_logits [R, k+1, V], draft_tokens [R, k], num_drafts [R],
                     draft_probs [R, k, V] | None, greedy [R], seed [R], token_index [R])
        -> (out_tokens int32 [R, k+1], num_emitted int32 [R])

`target_logits[r, j]` is the target's distribution for the token after draft j - 1 (j = 0:
after the row's last accepted token) as logits: `sampling.sampler.processed_logits` gives it
(penalties, temperature, the top-k / top-p / min-p cut at -inf; greedy rows keep their
logits). Row r has num_drafts[r] <= k drafts; it emits its accepted drafts then one more
token, 1..num_drafts[r] + 1 in all, and out_tokens holds -1 after them.

The rule, per row, for j = 0, 1, ...:
  * greedy rows: accept draft j while it is the argmax of target j; emit the argmax at the
    first mismatch, or at position num_drafts when every draft is accepted (the bonus).
  * point-mass drafts (draft_probs None: n-gram, or any deterministic drafter): the target
    draws its token at j exactly as the plain sampler would — Gumbel-max with the noise
    G(seed, token_index + j, v) of sampling/noise.py — and the draft is accepted iff it is
    that token. This *is* rejection sampling with q = a point mass at the draft: the draft
    is accepted with probability p(d) = min(1, p(d)/q(d)), and a rejected row emits a draw
    from p restricted to v != d, which is norm(max(0, p - q)). And it is token-identical to
    decoding without speculation under the same seed.
  * drafts with probabilities q (a draft model, EAGLE-3): accept draft x_j iff
    u_j * q(x_j) < p(x_j), with u_j uniform from the same counter-based hash (its own lane,
    so independent of every Gumbel draw); at the first rejection emit a draw from
    norm(max(0, p - q)), if all are accepted a draw from p at num_drafts (the bonus), both
    by Gumbel-max with G(seed, token_index + j, v). The emitted tokens follow the target's
    distribution whatever q is. Drafters must draw their drafts with noise of their own
    (`draft_seed`; spec/draft.py's `sample_drafts`), never G(seed, ...) itself: the rule
    needs the draft independent of u_j and of the residual's draw.

Randomness depends only on (seed, token_index + j, v), never on the batch, so seeded runs
are reproducible and sync and async runs agree. No host sync, fixed shapes: capturable in a
CUDA graph on the GPU, where the draws run in the sampler's Triton kernel (no [R, k+1, V]
noise tensor is built).
"""
from __future__ import annotations

import torch

from slipstream.sampling.noise import bits, row_keys
from slipstream.sampling.sampler import SamplerFlags, SamplingTensors, sample

#: the hash lane of the acceptance uniforms: outside every vocabulary, so u_j never shares
#: bits with a Gumbel draw G(seed, token_index + j, v)
ACCEPT_LANE = 0xFFFFFFFF
#: drafters that sample draw with seed ^ DRAFT_SEED_SALT (see `draft_seed`)
DRAFT_SEED_SALT = 0x5DEECE66D

_PLAIN = SamplerFlags(use_top_k_top_p=False, use_penalties=False, num_logprobs=0)


def draft_seed(seed: torch.Tensor) -> torch.Tensor:
    """The seeds a sampling drafter draws its drafts with: independent of the target's draws."""
    return seed.long() ^ DRAFT_SEED_SALT


def acceptance_uniforms(seed: torch.Tensor, token_index: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [R, k] in (0, 1): u_j for draft j of each row (24-bit, like the Gumbel draws)."""
    idx = token_index.long()[:, None] + torch.arange(k, device=seed.device)[None, :]
    k1, k2 = row_keys(seed.long()[:, None].expand(-1, k), idx)
    h = bits(torch.full_like(k1, ACCEPT_LANE), k1, k2)
    return ((h >> 8).to(torch.float32) + 0.5) * 5.9604644775390625e-08


def draw_tokens(logits: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor,
          token_index: torch.Tensor) -> torch.Tensor:
    """int32 [N]: the plain sampler's token from logits that are already the distribution
    (temperature 1, nothing cut; greedy rows: the argmax)."""
    n = logits.shape[0]
    ones = torch.ones(n, dtype=torch.float32, device=logits.device)
    t = SamplingTensors(
        temperature=torch.where(greedy, torch.zeros_like(ones), ones),
        top_k=torch.zeros(n, dtype=torch.int32, device=logits.device),
        top_p=ones, min_p=torch.zeros_like(ones), seed=seed.long(),
        token_index=token_index.to(torch.int32), repetition_penalty=ones,
        presence_penalty=torch.zeros_like(ones), frequency_penalty=torch.zeros_like(ones),
        state_row=torch.zeros(n, dtype=torch.int32, device=logits.device),
        inv_t=ones, log_min_p=torch.full_like(ones, float("-inf")))
    return sample(logits, t, _PLAIN).tokens


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised (a Gumbel-max draw does not need the sum); where p == q
    leaves no mass (float rounding can still reject), p itself."""
    residual = (p - q).clamp(min=0.0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """int64 [R]: how many leading entries of the bool [R, k] `accept` are True."""
    return accept.to(torch.int32).cumprod(dim=1).sum(dim=1).long()


def rejection_sample(target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, greedy: torch.Tensor, seed: torch.Tensor,
                     token_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row emits (module doc). `seed` int64 [R] is the request's sampling
    seed, `token_index` [R] the output index of the token drawn at position 0 (position j
    draws index token_index + j, as the plain sampler would)."""
    R, k1, V = target_logits.shape
    k = k1 - 1
    if draft_tokens.shape != (R, k):
        raise ValueError(f"draft_tokens must be [R, k] = [{R}, {k}], got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (R, k, V):
        raise ValueError(f"draft_probs must be [R, k, V] = [{R}, {k}, {V}], got {tuple(draft_probs.shape)}")
    device = target_logits.device
    logits = target_logits.float()
    drafts = draft_tokens.long()
    pos = torch.arange(k1, device=device)
    in_range = pos[None, :k] < num_drafts.long()[:, None]  # [R, k]
    seed = seed.long()
    index = token_index.long()
    if draft_probs is None:
        # every position's target draw, as the plain sampler makes it
        rows_greedy = greedy[:, None].expand(R, k1).reshape(-1)
        rows_seed = seed[:, None].expand(R, k1).reshape(-1)
        rows_index = (index[:, None] + pos[None, :]).reshape(-1)
        drawn = draw_tokens(logits.reshape(R * k1, V), rows_greedy, rows_seed, rows_index).view(R, k1)
        accepted = _accepted_prefix((drawn[:, :k].long() == drafts) & in_range)
        out = drawn
    else:
        p = torch.softmax(logits, dim=-1)
        q = draft_probs.float()
        safe = drafts.clamp(0, V - 1)[..., None]
        p_x = p[:, :k].gather(2, safe).squeeze(2)
        q_x = q.gather(2, safe).squeeze(2)
        u = acceptance_uniforms(seed, index, k)
        accept_sampled = u * q_x < p_x
        accept_greedy = drafts == logits[:, :k].argmax(dim=-1)
        accept = torch.where(greedy[:, None], accept_greedy, accept_sampled) & in_range
        accepted = _accepted_prefix(accept)  # the emitted token's position
        at = accepted[:, None, None].expand(R, 1, V)
        p_at = p.gather(1, at).squeeze(1)
        q_at = q.gather(1, accepted.clamp(max=max(k - 1, 0))[:, None, None].expand(R, 1, V)).squeeze(1) \
            if k else torch.zeros_like(p_at)
        residual = _residual(p_at, q_at)
        rejected = accepted < num_drafts.long()
        final = torch.where((rejected & ~greedy)[:, None], residual.log(), logits.gather(1, at).squeeze(1))
        token = draw_tokens(final, greedy, seed, index + accepted).long()
        out = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
        out = out.scatter(1, accepted[:, None], token[:, None])
    keep = pos[None, :] <= accepted[:, None]
    out_tokens = torch.where(keep, out.to(torch.int32), torch.full_like(out, -1, dtype=torch.int32))
    return out_tokens, (accepted + 1).to(torch.int32)
