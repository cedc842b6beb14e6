"""Speculative sampling's acceptance: greedy rows exact, point-mass (n-gram) rows token-identical
to the plain seeded sampler, and with draft probabilities the emitted tokens follow the
target's distribution whatever the draft's (a chi-square bound that wrong rules fail)."""
from __future__ import annotations

import pytest
import torch

import slipstream.spec.rejection as rej
from slipstream.sampling.sampler import (
    PenaltyState,
    SamplerFlags,
    SamplingTensors,
    processed_logits,
    sample_ref,
)
from slipstream.spec.rejection import acceptance_uniforms, draft_seed, rejection_sample

PLAIN = SamplerFlags(use_top_k_top_p=False, use_penalties=False, num_logprobs=0)


def _greedy_reference(logits, drafts, num_drafts):
    out = []
    for r in range(logits.shape[0]):
        row = []
        for j in range(int(num_drafts[r]) + 1):
            best = int(logits[r, j].argmax())
            row.append(best)
            if j == int(num_drafts[r]) or int(drafts[r, j]) != best:
                break
        out.append(row)
    return out


def _as_lists(out_tokens, num_emitted):
    rows = []
    for r in range(out_tokens.shape[0]):
        n = int(num_emitted[r])
        assert (out_tokens[r, n:] == -1).all() and (out_tokens[r, :n] >= 0).all()
        rows.append(out_tokens[r, :n].tolist())
    return rows


@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_rows_accept_while_the_draft_is_the_argmax(with_probs):
    g = torch.Generator().manual_seed(0)
    R, k, V = 32, 4, 7
    logits = torch.randn(R, k + 1, V, generator=g)
    best = logits.argmax(-1)
    drafts = torch.randint(0, V, (R, k), generator=g)
    # rows agree with the argmax for a random prefix, so every accepted length shows up
    agree = torch.randint(0, k + 1, (R,), generator=g)
    for r in range(R):
        drafts[r, :agree[r]] = best[r, :agree[r]]
    num_drafts = torch.randint(0, k + 1, (R,), generator=g)
    num_drafts[:3] = k
    probs = torch.softmax(torch.randn(R, k, V, generator=g), -1) if with_probs else None
    out, n = rejection_sample(logits, drafts, num_drafts, probs, torch.ones(R, dtype=torch.bool),
                              torch.arange(R), torch.zeros(R, dtype=torch.int32))
    assert out.dtype == torch.int32 and out.shape == (R, k + 1) and n.dtype == torch.int32
    assert _as_lists(out, n) == _greedy_reference(logits, drafts, num_drafts)
    assert n.max() == k + 1 and n.min() == 1


def test_point_mass_drafts_give_the_plain_samplers_tokens():
    """With n-gram drafts a seeded speculative run emits what the plain sampler draws at
    each token index: speculation does not change a seeded request's output."""
    g = torch.Generator().manual_seed(1)
    R, k, V = 48, 3, 11
    raw = torch.randn(R, k + 1, V, generator=g) * 2
    temperature = torch.rand(R, generator=g) + 0.3
    temperature[:8] = 0.0
    greedy = temperature < 1e-5
    seed = torch.randint(0, 2**40, (R,), generator=g)
    token_index = torch.randint(0, 1000, (R,), generator=g, dtype=torch.int32)
    # the plain sampler's draw at every position (the target's own tokens)
    plain = torch.empty(R, k + 1, dtype=torch.long)
    for j in range(k + 1):
        t = SamplingTensors.from_lists(temperature.tolist(), seed=seed.tolist(),
                                       token_index=(token_index + j).tolist())
        plain[:, j] = sample_ref(raw[:, j], t, PLAIN).tokens.long()
    # drafts agree with those draws for a random prefix, then differ
    agree = torch.randint(0, k + 1, (R,), generator=g)
    drafts = (plain[:, :k] + 1) % V
    for r in range(R):
        drafts[r, :agree[r]] = plain[r, :agree[r]]
    inv_t = torch.where(greedy, torch.ones_like(temperature), temperature).reciprocal()
    target = raw * inv_t[:, None, None]  # processed_logits without a cut
    out, n = rejection_sample(target, drafts, torch.full((R,), k), None, greedy, seed, token_index)
    for r, row in enumerate(_as_lists(out, n)):
        assert len(row) == int(agree[r]) + 1
        assert row == plain[r, :len(row)].tolist()


def test_point_mass_drafts_keep_top_k_top_p_min_p_and_penalties_token_identical():
    """Through processed_logits (the sampler's own cut), rows with top-k, top-p, min-p and
    penalties still emit exactly the plain sampler's tokens."""
    g = torch.Generator().manual_seed(2)
    R, k, V = 40, 3, 64
    raw = torch.randn(R, k + 1, V, generator=g) * 3
    cols = dict(temperature=(torch.rand(R, generator=g) + 0.2).tolist(),
                top_k=torch.randint(0, 20, (R,), generator=g).tolist(),
                top_p=(torch.rand(R, generator=g) * 0.6 + 0.4).tolist(),
                min_p=(torch.rand(R, generator=g) * 0.2).tolist(),
                seed=torch.randint(0, 2**31, (R,), generator=g).tolist(),
                repetition_penalty=(torch.rand(R, generator=g) + 0.8).tolist(),
                presence_penalty=torch.rand(R, generator=g).tolist(),
                frequency_penalty=torch.rand(R, generator=g).tolist(), state_row=list(range(R)))
    cols["temperature"][:5] = [0.0] * 5
    flags = SamplerFlags(use_top_k_top_p=True, use_penalties=True, num_logprobs=0)
    state = PenaltyState(R, V)
    for r in range(R):
        state.reset_row(r, torch.randint(0, V, (6,), generator=g), torch.randint(0, V, (4,), generator=g))
    token_index = torch.randint(0, 100, (R,), generator=g, dtype=torch.int32)
    plain, target = torch.empty(R, k + 1, dtype=torch.long), torch.empty(R, k + 1, V)
    for j in range(k + 1):
        # (the penalty state stays that of the row's history: enough to compare the two paths)
        t = SamplingTensors.from_lists(token_index=(token_index + j).tolist(), **cols)
        plain[:, j] = sample_ref(raw[:, j], t, flags, state).tokens.long()
        target[:, j] = processed_logits(raw[:, j], t, flags, state)
    agree = torch.randint(0, k + 1, (R,), generator=g)
    drafts = (plain[:, :k] + 1) % V
    for r in range(R):
        drafts[r, :agree[r]] = plain[r, :agree[r]]
    greedy = torch.tensor(cols["temperature"]) < 1e-5
    out, n = rejection_sample(target, drafts, torch.full((R,), k), None, greedy,
                              torch.tensor(cols["seed"]), token_index)
    for r, row in enumerate(_as_lists(out, n)):
        assert row == plain[r, :int(agree[r]) + 1].tolist()


def _first_tokens(p0, p1, q, n, drafter_seed=7, rule=rejection_sample):
    """n rows, one seed each: drafts drawn from q (its own generator), the target p0, p1."""
    V = p0.shape[0]
    g = torch.Generator().manual_seed(drafter_seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, 2]
    logits = torch.stack([p0.log(), p1.log(), p1.log()])[None].expand(n, 3, V)
    probs = q[None].expand(n, 2, V)
    out, num = rule(logits, drafts, torch.full((n,), 2), probs, torch.zeros(n, dtype=torch.bool),
                    torch.arange(n) * 7919 + 3, torch.zeros(n, dtype=torch.int32))
    return out, num


def _chi2(samples, p):
    counts = torch.bincount(samples, minlength=p.shape[0]).double()
    expected = p.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# df = 5 (V = 6): P(chi2 > 30) ~ 1.5e-5; the draws are seeded, so the test is deterministic
BOUND = 30.0
P0 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
P1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
QS = {"far": torch.tensor([0.02, 0.03, 0.05, 0.10, 0.30, 0.50]),
      "uniform": torch.full((6,), 1 / 6),
      "close": torch.tensor([0.35, 0.30, 0.15, 0.10, 0.05, 0.05])}


@pytest.mark.parametrize("q", sorted(QS))
def test_emitted_tokens_follow_the_target_whatever_the_draft(q):
    out, num = _first_tokens(P0, P1, QS[q][None].expand(2, 6), 40000)
    assert _chi2(out[:, 0].long(), P0) < BOUND
    # a token emitted after an accepted draft follows the target at its position too
    second = out[num >= 2, 1].long()
    assert second.numel() > 2000
    assert _chi2(second, P1) < BOUND


def test_point_mass_drafts_follow_the_target():
    n, V = 40000, 6
    logits = torch.stack([P0.log(), P1.log()])[None].expand(n, 2, V)
    out, _ = rejection_sample(logits, torch.full((n, 1), 4), torch.ones(n, dtype=torch.long), None,
                              torch.zeros(n, dtype=torch.bool), torch.arange(n) * 31 + 1,
                              torch.zeros(n, dtype=torch.int32))
    assert _chi2(out[:, 0].long(), P0) < BOUND


def test_the_bound_fails_wrong_rules(monkeypatch):
    """The test of the test: accepting every draft, or drawing a rejected row's token from p
    instead of norm(max(0, p - q)), breaks the bound."""
    q = QS["far"][None].expand(2, 6)

    def accept_all(logits, drafts, num_drafts, probs, greedy, seed, index):
        out = torch.cat([drafts, drafts[:, :1]], 1).to(torch.int32)
        return out, torch.full((drafts.shape[0],), 3, dtype=torch.int32)
    out, _ = _first_tokens(P0, P1, q, 40000, rule=accept_all)
    assert _chi2(out[:, 0].long(), P0) > 10 * BOUND
    # accepting with probability min(1, p/q) but resampling from p
    monkeypatch.setattr(rej, "_residual", lambda p, q: p)
    out, _ = _first_tokens(P0, P1, q, 40000)
    assert _chi2(out[:, 0].long(), P0) > 10 * BOUND


def test_seeded_runs_are_reproducible_and_seeds_matter():
    q = QS["uniform"][None].expand(2, 6)
    a, na = _first_tokens(P0, P1, q, 2000)
    b, nb = _first_tokens(P0, P1, q, 2000)
    assert torch.equal(a, b) and torch.equal(na, nb)
    u1 = acceptance_uniforms(torch.tensor([5, 6]), torch.tensor([0, 0]), 4)
    u2 = acceptance_uniforms(torch.tensor([5, 6]), torch.tensor([1, 1]), 4)
    assert ((u1 > 0) & (u1 < 1)).all() and not torch.equal(u1[0], u1[1])
    assert torch.equal(u1[:, 1:], u2[:, :3])  # position j draws index token_index + j
    assert (draft_seed(torch.tensor([5])) != 5).all()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="draft_tokens must be"):
        rejection_sample(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2),
                         None, torch.zeros(2, dtype=torch.bool), torch.zeros(2), torch.zeros(2))
