"""The sampler's random draws: a counter-based hash of (the request's seed, its token index,
the vocabulary id), so a request's draws never depend on the batch it runs in, and sync and
async runs sample the same tokens. This is the pure-torch reference of the Triton kernel's
hash (ops/triton_sampling.py), which uses the same constants."""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MIX_M1 = 0x21F0AAAD
_MIX_M2 = 0x735A2D97
_KEY_C1 = 0x2545F491
_KEY_C2 = 0x68E31DA4
#: bounds of the noise G as computed from 24-bit uniforms (with a safety margin)
G_MAX = 17.4
G_MIN = -2.86


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for int64 x in [0, 2**32), every intermediate < 2**49 (exact)
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_M2)
    return x ^ (x >> 15)


def row_keys(seed: torch.Tensor, token_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seed = seed.long()
    lo = seed & _MASK32
    hi = (seed >> 32) & _MASK32
    ti = token_index.long() & _MASK32
    k1 = _mix32(lo ^ _KEY_C1)
    k1 = _mix32(k1 ^ hi)
    k1 = _mix32(k1 ^ ti)
    k2 = _mix32(k1 ^ _KEY_C2)
    return k1, k2


def bits(v: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    return _mix32(_mix32(v ^ k1) ^ k2)


def gumbel_from_bits(h: torch.Tensor) -> torch.Tensor:
    m = (h >> 8).to(torch.float32)
    scale = 5.9604644775390625e-08  # 2**-24
    u = (m + 0.5) * scale
    w = ((16777215.0 - m) + 0.5) * scale
    series = w * (1.0 + w * (0.5 + w * (0.3333333432674408 + w * (0.25 + w * 0.20000000298023224))))
    e = torch.where(w < 0.015625, series, -torch.log(u))
    return -torch.log(e)


def random_bits_ref(seed: torch.Tensor, token_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The 32-bit hash h(seed, token_index, v) for v < vocab_size, int64 [B, V]."""
    k1, k2 = row_keys(seed, token_index)
    v = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    return bits(v[None, :], k1[:, None], k2[:, None])


def gumbel_noise_ref(seed: torch.Tensor, token_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The noise G(seed, token_index, v), float32 [B, V]."""
    return gumbel_from_bits(random_bits_ref(seed, token_index, vocab_size))
