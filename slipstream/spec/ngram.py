"""Prompt-lookup (n-gram) drafting: propose the tokens that followed an earlier occurrence of
the sequence's own last n tokens.

The rule, shared by both implementations: for n from max_n down to min_n, look for an
occurrence of the last n tokens that ends before the last token (it may overlap the suffix);
the first n that has one wins, and among its occurrences the *earliest* is taken, since it
has the most tokens after it. The drafts are the (up to) k tokens that follow it, cut at the
end of the history; no occurrence of any n: no drafts.

`propose_ngram` is the host reference (numpy, one sequence). `propose_ngram_device` is the
batched torch version the engine runs on the GPU after the accepted tokens are known, so
drafting needs no CPU round trip under async scheduling: fixed shapes, no host sync, CUDA
graph capturable. It costs max_n compare passes over the [R, L] history.
"""
from __future__ import annotations

import numpy as np
import torch


def _check(k: int, min_n: int, max_n: int) -> None:
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"n-gram drafting needs k >= 1 and 1 <= min_n <= max_n, got "
                         f"k={k}, min_n={min_n}, max_n={max_n}")


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """The drafts for one sequence `tokens` (1-D ints): at most k tokens, int32 (module doc)."""
    _check(k, min_n, max_n)
    t = np.asarray(tokens).reshape(-1)
    length = t.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # the windows starting at s <= length - n - 1 (ending at s + n - 1 <= length - 2),
        # compared with the suffix at once: a Python loop over s costs ~5 ms a row at 600 tokens
        windows = np.lib.stride_tricks.sliding_window_view(t, n)[:length - n]
        hits = np.flatnonzero((windows == t[length - n:]).all(axis=1))
        if hits.size:
            s = int(hits[0])
            return t[s + n:s + n + k].astype(np.int32)
    return np.zeros(0, dtype=np.int32)


def has_ngram_match(tokens: np.ndarray, min_n: int) -> bool:
    """Whether `propose_ngram(tokens, k, min_n, max_n)` drafts anything, for any k and max_n:
    whether the last min_n tokens occur ending before the last token (a longer n-gram that
    occurs contains that occurrence).  min_n compares over the tokens, no window arrays:
    the asynchronous scheduler asks it of every decode row every step."""
    t = np.asarray(tokens).reshape(-1)
    length = t.shape[0]
    if min_n < 1 or length <= min_n:
        return False
    m = length - min_n  # windows starting at s < m end at s + min_n - 1 <= length - 2
    hit = t[:m] == t[m]
    for i in range(1, min_n):
        hit &= t[i:m + i] == t[m + i]
    return bool(hit.any())


def propose_ngram_device(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                         max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts for R sequences at once: `history` int32 [R, L] (row r's tokens in
    history[r, :lengths[r]], anything after), `lengths` int32 [R]. Returns (drafts int32
    [R, k], num_drafts int32 [R]); row r's drafts are drafts[r, :num_drafts[r]], equal to
    propose_ngram(history[r, :lengths[r]], ...), and the entries after them are 0 (a valid
    token id, so a verification forward may run them as padding)."""
    _check(k, min_n, max_n)
    R, L = history.shape
    device = history.device
    pos = torch.arange(L, device=device)
    last = lengths.long() - 1  # [R]: the index of each row's last token
    # match[r, e]: how many tokens ending at e equal the tokens ending at last (capped at
    # max_n), built one offset at a time: token e - i against token last - i
    run = torch.ones(R, L, dtype=torch.bool, device=device)
    match = torch.zeros(R, L, dtype=torch.int32, device=device)
    for i in range(max_n):
        shifted = history if i == 0 else torch.nn.functional.pad(history[:, :L - i], (i, 0))
        target = history.gather(1, (last - i).clamp(min=0)[:, None])
        run &= (shifted == target) & (pos >= i)[None, :] & (last >= i)[:, None]
        match += run.to(torch.int32)
    # an occurrence must end before the last token (and after the row's start)
    match = torch.where(pos[None, :] < last[:, None], match, torch.zeros_like(match))
    best = match.amax(dim=1)  # [R]: the longest n that occurs
    found = best >= min_n
    hit = (match >= best[:, None]) & found[:, None]
    end = hit.to(torch.int32).argmax(dim=1).long()  # the earliest end of the longest n-gram
    idx = end[:, None] + 1 + torch.arange(k, device=device)[None, :]
    num = torch.where(found, torch.clamp(last - end, max=k), torch.zeros_like(last))
    valid = torch.arange(k, device=device)[None, :] < num[:, None]
    drafts = history.gather(1, idx.clamp(max=L - 1))
    drafts = torch.where(valid, drafts, torch.zeros_like(drafts))
    return drafts.to(torch.int32), num.to(torch.int32)
