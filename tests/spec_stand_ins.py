"""Minimal stand-ins for `slipstream.spec.ngram` and `slipstream.spec.rejection`, installed
only while those modules are missing from the tree (another change brings them): the
engine tests then check the engine's plumbing against these simple references.

`install()` returns True when it installed them."""
from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import torch


def propose_ngram(tokens, k: int, min_n: int, max_n: int) -> np.ndarray:
    """The k tokens after the most recent earlier occurrence of the longest suffix n-gram."""
    tokens = np.asarray(tokens)
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if (tokens[start:start + n] == suffix).all():
                return tokens[start + n:start + n + k].astype(np.int32)
    return np.zeros(0, np.int32)


def rejection_sample(target_logits, draft_tokens, num_drafts, draft_probs, greedy, **_):
    """Greedy rows only: accept drafts while they equal the argmax, then emit the argmax."""
    assert bool(greedy.all()), "the stand-in verifies greedy rows only"
    R, K1, _ = target_logits.shape
    best = target_logits.argmax(-1).to(torch.int32)  # [R, K1]
    ok = (best[:, :-1] == draft_tokens) & (torch.arange(K1 - 1)[None, :] < num_drafts[:, None])
    accepted = ok.int().cumprod(1).sum(1)
    num = accepted + 1
    out = torch.where(torch.arange(K1)[None, :] < num[:, None], best, torch.full_like(best, -1))
    return out, num.to(torch.int32)


def install() -> bool:
    installed = False
    for name, funcs in (("ngram", {"propose_ngram": propose_ngram}),
                        ("rejection", {"rejection_sample": rejection_sample})):
        full = f"slipstream.spec.{name}"
        try:
            importlib.import_module(full)
        except ImportError:
            module = types.ModuleType(full)
            module.__dict__.update(funcs)
            sys.modules[full] = module
            installed = True
    return installed
