"""Speculative sampling over several steps of a context-dependent target: a Markov chain over 4
tokens stands in for the target, another for the drafter. Each step drafts k tokens, verifies
them with rejection_sample and moves every row's token_index by what it emitted. The joint law
of the first three emitted tokens must be the target chain's (chi-square over 64 cells), with
sampled drafts (draft probabilities) and with deterministic drafts (point mass); not
advancing token_index (reusing draws across steps) must fail it."""
from __future__ import annotations

import pytest
import torch

from slipstream.spec.draft import sample_drafts
from slipstream.spec.rejection import rejection_sample

V, K, N, T = 4, 2, 20000, 3
START = 1
TARGET = torch.tensor([[0.50, 0.20, 0.20, 0.10],
                       [0.10, 0.60, 0.10, 0.20],
                       [0.25, 0.25, 0.25, 0.25],
                       [0.40, 0.10, 0.30, 0.20]])
DRAFTER = torch.tensor([[0.10, 0.10, 0.40, 0.40],
                        [0.30, 0.30, 0.20, 0.20],
                        [0.70, 0.10, 0.10, 0.10],
                        [0.25, 0.25, 0.25, 0.25]])
# chi-square, df = 63: P(> 123) ~ 1e-5 (Wilson-Hilferty); the draws are seeded: deterministic
BOUND = 123.0


def _generate(point_mass: bool, advance: bool = True) -> torch.Tensor:
    seed = torch.arange(N) * 2654435761 % 2**40 + 17
    greedy = torch.zeros(N, dtype=torch.bool)
    out = torch.full((N, T * (K + 1)), -1, dtype=torch.long)
    count = torch.zeros(N, dtype=torch.long)
    last = torch.full((N,), START)
    for _ in range(T):  # every step emits >= 1 token
        index = (count if advance else torch.zeros_like(count)).to(torch.int32)
        drafts, probs, prev = [], [], last
        for j in range(K):
            if point_mass:  # a deterministic drafter: the drafter chain's most likely token
                tok = DRAFTER[prev].argmax(-1)
            else:
                tok, q = sample_drafts(DRAFTER[prev].log(), greedy, seed, index + j)
                tok = tok.long()
                probs.append(q)
            drafts.append(tok)
            prev = tok
        drafts = torch.stack(drafts, 1)
        contexts = torch.cat([last[:, None], drafts], 1)  # position j follows contexts[:, j]
        target = TARGET[contexts].log()
        emitted, num = rejection_sample(target, drafts, torch.full((N,), K),
                                        None if point_mass else torch.stack(probs, 1), greedy, seed, index)
        cols = count[:, None] + torch.arange(K + 1)[None, :]
        keep = torch.arange(K + 1)[None, :] < num[:, None].long()
        rows = torch.arange(N)[:, None].expand(-1, K + 1)
        out[rows[keep], cols[keep]] = emitted[keep].long()
        count += num.long()
        last = out.gather(1, (count - 1)[:, None]).squeeze(1)
    assert (count >= T).all()
    return out[:, :T]


def _chi2(seqs: torch.Tensor) -> float:
    cells = (seqs[:, 0] * V + seqs[:, 1]) * V + seqs[:, 2]
    counts = torch.bincount(cells, minlength=V ** 3).double()
    a, b, c = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    probs = (TARGET[START][a] * TARGET[a, b] * TARGET[b, c]).reshape(-1).double()
    expected = probs * seqs.shape[0]
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("point_mass", [False, True])
def test_several_steps_follow_the_targets_joint_law(point_mass):
    assert _chi2(_generate(point_mass)) < BOUND


def test_the_bound_fails_reusing_token_indices_across_steps():
    assert _chi2(_generate(True, advance=False)) > BOUND
