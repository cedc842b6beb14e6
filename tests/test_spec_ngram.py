"""Prompt-lookup drafting: the host rule on hand-made cases, and the batched device version
equal to it row by row on random histories full of repeats."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.spec.ngram import has_ngram_match, propose_ngram, propose_ngram_device


def test_the_longest_suffix_ngram_wins_and_its_earliest_occurrence():
    #            0  1  2  3  4  5  6  7  8  9
    t = np.array([5, 1, 2, 9, 7, 1, 2, 3, 4, 1, 2])
    # suffix [1, 2] occurs at 1 and 5: the earliest (1) is followed by 9 7 1 2 3
    assert propose_ngram(t, 3, 1, 2).tolist() == [9, 7, 1]
    # a longer n that matches beats a shorter one: suffix [4, 1, 2] never occurs, [1, 2] does
    assert propose_ngram(t, 2, 2, 3).tolist() == [9, 7]
    # min_n above every match: nothing
    assert propose_ngram(t, 2, 3, 4).tolist() == []
    t2 = np.array([3, 8, 1, 2, 6, 6, 8, 1, 2])
    # [8, 1, 2] occurs at 1 (n = 3 wins over [1, 2], and over [2] at 3)
    assert propose_ngram(t2, 4, 1, 3).tolist() == [6, 6, 8, 1]


def test_drafts_are_cut_at_the_end_and_occurrences_may_overlap_the_suffix():
    t = np.array([7, 7, 7])
    # suffix [7, 7] occurs at 0 (overlapping the suffix), followed by one token
    assert propose_ngram(t, 5, 1, 2).tolist() == [7]
    assert propose_ngram(np.array([4]), 3, 1, 2).tolist() == []
    assert propose_ngram(np.array([], dtype=np.int64), 3, 1, 2).tolist() == []


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        propose_ngram(np.array([1, 2]), 2, 3, 2)
    with pytest.raises(ValueError, match="k >= 1"):
        propose_ngram_device(torch.zeros(1, 4, dtype=torch.int32), torch.tensor([2]), 0, 1, 2)


@pytest.mark.parametrize("k, min_n, max_n, vocab", [
    (1, 1, 1, 3), (3, 1, 3, 4), (4, 2, 5, 3), (5, 3, 3, 2), (2, 1, 6, 8), (7, 1, 2, 50)])
def test_the_device_version_equals_the_host_rule_row_by_row(k, min_n, max_n, vocab):
    g = torch.Generator().manual_seed(k * 100 + max_n * 10 + vocab)
    R, L = 64, 40
    history = torch.randint(0, vocab, (R, L), generator=g, dtype=torch.int32)
    # some rows repeat a block of themselves, so long matches and long drafts happen
    for r in range(0, R, 3):
        period = int(torch.randint(1, 8, (1,), generator=g))
        history[r] = history[r, :period].repeat(L // period + 1)[:L]
    lengths = torch.randint(0, L + 1, (R,), generator=g, dtype=torch.int32)
    lengths[:4] = torch.tensor([0, 1, 2, L], dtype=torch.int32)
    drafts, num = propose_ngram_device(history, lengths, k, min_n, max_n)
    assert drafts.shape == (R, k) and drafts.dtype == torch.int32 and num.dtype == torch.int32
    found = 0
    for r in range(R):
        want = propose_ngram(history[r, :lengths[r]].numpy(), k, min_n, max_n)
        n = int(num[r])
        assert n == len(want), (r, history[r, :lengths[r]].tolist())
        assert drafts[r, :n].tolist() == want.tolist()
        assert (drafts[r, n:] == 0).all()
        found += n > 0
    assert found > R // 4  # not vacuous: many rows draft


@pytest.mark.parametrize("min_n, vocab", [(1, 3), (2, 3), (2, 8), (3, 2), (4, 4)])
def test_has_ngram_match_says_whether_the_host_rule_drafts(min_n, vocab):
    """The scheduler's per-step question (may a row get draft slots) against the rule itself,
    for every max_n: lengths 0 .. 40, random and periodic token rows."""
    rng = np.random.default_rng(min_n * 10 + vocab)
    yes = no = 0
    for trial in range(300):
        t = rng.integers(0, vocab, int(rng.integers(0, 41)))
        if trial % 3 == 0 and len(t) > 2:
            period = int(rng.integers(1, 6))
            t = np.resize(t[:period], len(t))
        got = has_ngram_match(t, min_n)
        for max_n in (min_n, min_n + 1, min_n + 3):
            assert got == (len(propose_ngram(t, 2, min_n, max_n)) > 0), (t.tolist(), min_n, max_n)
        yes, no = yes + got, no + (not got)
    assert yes >= 20 and no >= 20  # both answers are exercised
