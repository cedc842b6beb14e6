"""A sampling drafter's draws (spec/draft.py): they follow q, they use noise independent of the
target's, and through rejection_sample a draft equal to the target accepts every draft while
the emitted tokens follow the target."""
from __future__ import annotations

import torch

import slipstream.spec.draft as draft_mod
from slipstream.spec.draft import sample_drafts
from slipstream.spec.rejection import rejection_sample

P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
BOUND = 30.0  # chi-square, df = 5 (see test_spec_rejection.py)


def _chi2(samples, p):
    counts = torch.bincount(samples.long(), minlength=p.shape[0]).double()
    expected = p.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def _run(p, q, n=40000, k=1):
    seed, index = torch.arange(n) * 104729 + 11, torch.full((n,), 5, dtype=torch.int32)
    greedy = torch.zeros(n, dtype=torch.bool)
    drafts, probs = [], []
    for j in range(k):
        tok, pr = sample_drafts(q.log()[None].expand(n, -1), greedy, seed, index + j)
        drafts.append(tok)
        probs.append(pr)
    target = p.log()[None, None].expand(n, k + 1, -1)
    out, num = rejection_sample(target, torch.stack(drafts, 1), torch.full((n,), k), torch.stack(probs, 1),
                                greedy, seed, index)
    return torch.stack(drafts, 1), out, num


def test_drafts_follow_q_and_the_emitted_tokens_follow_p():
    drafts, out, num = _run(P, Q)
    assert _chi2(drafts[:, 0], Q) < BOUND
    assert _chi2(out[:, 0], P) < BOUND
    assert 0 < (num == 2).float().mean() < 1


def test_a_draft_equal_to_the_target_accepts_every_draft():
    drafts, out, num = _run(P, P, n=5000, k=3)
    assert (num == 4).all() and torch.equal(out[:, :3], drafts.to(torch.int32))
    assert _chi2(out[:, 0], P) < BOUND and _chi2(out[:, 3], P) < BOUND


def test_greedy_rows_draft_the_argmax():
    logits = torch.randn(8, 6)
    tok, probs = sample_drafts(logits, torch.ones(8, dtype=torch.bool), torch.arange(8), torch.zeros(8))
    assert torch.equal(tok.long(), logits.argmax(-1)) and torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert (probs.sum(-1) == 1).all()


def test_drafting_with_the_targets_own_noise_breaks_the_rule(monkeypatch):
    """The test of the test: with the target's noise (no draft_seed), the draft and the
    residual's draw are correlated and the emitted tokens no longer follow p."""
    monkeypatch.setattr(draft_mod, "draft_seed", lambda seed: seed)
    _, out, _ = _run(P, Q)
    assert _chi2(out[:, 0], P) > BOUND
