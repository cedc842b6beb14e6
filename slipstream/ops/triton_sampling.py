"""Triton kernel of the sampler: temperature, cutoff, Gumbel noise and argmax in one pass.

The semantics (and the torch twin used on CPU and as the oracle) live in
`slipstream.sampling.sampler`; read its module docstring first. This kernel must reproduce
`slipstream.sampling.sampler.sample_ref` exactly: the same 32-bit hash, the same float32
operations in the same order, the same tie-breaking (first index of the maximum).

Work split: grid (rows, splits). Each program scans one contiguous range of the
vocabulary in chunks of BLOCK_V and keeps (best value, first index reaching it).
With one split the program writes the token; otherwise a second tiny kernel picks,
per row, the first split holding the maximum. Splitting the vocabulary keeps the GPU
busy when the batch is small; rows with min-p then read their whole row once more for
the row maximum (min-p needs it before any token can be judged).

Chunk skipping: the noise g is bounded (-2.86 < g < 17.4, see `sampling.noise.G_MAX`), so a
chunk whose best kept scaled value s satisfies s + 32 < s_run - 3, where s_run is the
largest kept scaled value seen so far, cannot hold the winner, and its noise is never
computed (the test of `sampler.sample_ref`'s candidates). Rounding is monotone, so this
never changes the result (|scaled| < 2**28). Peaked distributions skip almost every chunk.

No host syncs; the grid depends only on shapes: CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.device import sm_count
from slipstream.ops.pdl import pdl_launch, pdl_start

__all__ = ["sample_tokens_triton", "gumbel_noise_triton", "random_bits_triton"]


@triton.jit
def mix32(x):
    # 32-bit integer finaliser (xorshift-multiply, two rounds); x is uint32, wraps mod 2**32
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    x = x ^ (x >> 15)
    return x


@triton.jit
def row_keys(seed_ptr, tidx_ptr, row):
    seed = tl.load(seed_ptr + row)  # int64
    lo = seed.to(tl.uint32)  # low word (truncation)
    hi = (seed >> 32).to(tl.uint32)  # high word
    ti = tl.load(tidx_ptr + row).to(tl.uint32)
    k1 = mix32(lo ^ 0x2545F491)
    k1 = mix32(k1 ^ hi)
    k1 = mix32(k1 ^ ti)
    k2 = mix32(k1 ^ 0x68E31DA4)
    return k1, k2


@triton.jit
def _bits(v, k1, k2):
    # v: uint32 token ids -> uint32 random bits
    return mix32(mix32(v ^ k1) ^ k2)


@triton.jit
def _gumbel(h):
    # h: uint32 random bits -> Gumbel(0, 1) noise, float32
    m = (h >> 8).to(tl.float32)  # 24 bits, exact
    u = (m + 0.5) * 5.9604644775390625e-08  # (m + 1/2) / 2**24 in (0, 1), exact
    w = ((16777215.0 - m) + 0.5) * 5.9604644775390625e-08  # 1 - u, exact
    # E = -log(u), Exponential(1); for u near 1 use the series of -log(1 - w) (no cancellation)
    series = w * (1.0 + w * (0.5 + w * (0.3333333432674408 + w * (0.25 + w * 0.20000000298023224))))
    e = tl.where(w < 0.015625, series, -tl.log(u))
    return -tl.log(e)


@triton.jit
def _load_logits(base, offs, hi, mask_row_ptr, HAS_MASK: tl.constexpr):
    # float32 logits of `offs` (< hi); with a token bitmask, disallowed tokens read -inf
    valid = offs < hi
    x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        words = tl.load(mask_row_ptr + offs // 32, mask=valid, other=0)
        allowed = ((words >> (offs % 32)) & 1) != 0
        x = tl.where(allowed, x, float("-inf"))
    return x


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, V, span,
    temp_ptr, inv_t_ptr, cutoff_ptr, lmp_ptr, seed_ptr, tidx_ptr,
    part_val_ptr, part_idx_ptr, tokens_ptr,
    num_splits, mask_ptr, mask_stride,
    HAS_MASK: tl.constexpr,
    HAS_CUTOFF: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    mask_row_ptr = mask_ptr + row.to(tl.int64) * mask_stride
    v_lo = split * span
    v_hi = tl.minimum(v_lo + span, V)
    arange = tl.arange(0, BLOCK_V)

    # every lane keeps its own best (value, first index) across chunks; one reduction at
    # the end instead of three per chunk
    best_vals = tl.zeros([BLOCK_V], tl.float32) - float("inf")
    best_idxs = tl.zeros([BLOCK_V], tl.int32)
    temp = tl.load(temp_ptr + row)
    if temp < 1e-5:
        # greedy: first index of the maximum (penalised) logit
        for start in range(v_lo, v_hi, BLOCK_V):
            offs = start + arange
            x = _load_logits(base, offs, v_hi, mask_row_ptr, HAS_MASK)
            better = x > best_vals  # strict: a lane keeps its first index reaching its maximum
            best_idxs = tl.where(better, offs, best_idxs)
            best_vals = tl.where(better, x, best_vals)
    else:
        inv_t = tl.load(inv_t_ptr + row)
        thr = tl.zeros([], tl.float32) - float("inf")
        if HAS_CUTOFF:
            thr = tl.load(cutoff_ptr + row)  # top-k / top-p / min-p, folded by the host code
        else:
            lmp = tl.load(lmp_ptr + row)
            if lmp > -3.0e38:
                # min-p: needs the row maximum of the scaled logits (= max logit * inv_t)
                mx = tl.zeros([], tl.float32) - float("inf")
                for start in range(0, V, BLOCK_V):
                    offs = start + arange
                    x = _load_logits(base, offs, V, mask_row_ptr, HAS_MASK)
                    mx = tl.maximum(mx, tl.max(x, axis=0))
                smax = mx * inv_t
                thr = tl.minimum(smax + lmp, smax)
        k1, k2 = row_keys(seed_ptr, tidx_ptr, row)
        s_run = tl.zeros([], tl.float32) - float("inf")  # max kept scaled value so far
        for start in range(v_lo, v_hi, BLOCK_V):
            offs = start + arange
            valid = offs < v_hi
            x = _load_logits(base, offs, v_hi, mask_row_ptr, HAS_MASK)
            s = x * inv_t
            keep = valid & (s >= thr)
            chunk_max = tl.max(tl.where(keep, s, float("-inf")), axis=0)
            # the token holding s_run scores >= s_run - 2.86, anything here <= chunk_max + 17.4:
            # a chunk with chunk_max + 32 < s_run - 3 cannot win and gets no noise
            if chunk_max + 32.0 >= s_run - 3.0:
                s_run = tl.maximum(s_run, chunk_max)
                g = _gumbel(_bits(offs.to(tl.uint32), k1, k2))
                val = tl.where(keep, s + g, float("-inf"))
                better = val > best_vals
                best_idxs = tl.where(better, offs, best_idxs)
                best_vals = tl.where(better, val, best_vals)
    # the first index reaching the maximum: the smallest lane index among lanes holding it
    best_val = tl.max(best_vals, axis=0)
    best_idx = tl.min(tl.where(best_vals == best_val, best_idxs, 2147483647), axis=0)
    best_idx = tl.where(best_idx == 2147483647, v_lo, best_idx)  # no lane compares equal (NaN)

    if SINGLE:
        tl.store(tokens_ptr + row, best_idx)
    else:
        tl.store(part_val_ptr + row * num_splits + split, best_val)
        tl.store(part_idx_ptr + row * num_splits + split, best_idx)


@triton.jit
def _reduce_splits_kernel(part_val_ptr, part_idx_ptr, tokens_ptr, num_splits,
                          BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_splits
    vals = tl.load(part_val_ptr + row * num_splits + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + row * num_splits + offs, mask=mask, other=0)
    # splits are in vocabulary order: the first split holding the maximum holds the
    # first index reaching it
    m = tl.max(vals, axis=0)
    first = tl.min(tl.where(mask & (vals == m), offs, BLOCK_S), axis=0)
    first = tl.where(first == BLOCK_S, 0, first)  # no split compares equal (NaN): split 0
    tok = tl.sum(tl.where(offs == first, idxs, 0), axis=0)
    tl.store(tokens_ptr + row, tok)


@triton.jit
def _noise_kernel(seed_ptr, tidx_ptr, out_ptr, V, stride_out,
                  GUMBEL: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    k1, k2 = row_keys(seed_ptr, tidx_ptr, row)
    h = _bits(offs.to(tl.uint32), k1, k2)
    if GUMBEL:
        tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, _gumbel(h), mask=mask)
    else:
        tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, h.to(tl.int64), mask=mask)




def sample_tokens_triton(logits: torch.Tensor, temperature: torch.Tensor, inv_t: torch.Tensor,
                         log_min_p: torch.Tensor, cutoff: torch.Tensor | None,
                         seed: torch.Tensor, token_index: torch.Tensor, *,
                         bitmask: torch.Tensor | None = None,
                         num_splits: int | None = None, block_v: int | None = None,
                         num_warps: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row; int32 [B].

    logits: float32 / bfloat16 / float16 [B, V] (penalised; read as float32); temperature/inv_t/log_min_p: float32 [B]
    (inv_t = 1 / temperature, 1 for greedy rows; log_min_p = log(min_p), -inf = off);
    cutoff: float32 [B] threshold on the scaled logits that already folds top-k, top-p
    and min-p (then log_min_p is not read), or None; seed int64 [B]; token_index int32 [B];
    bitmask: int32 [B, ceil(V / 32)] allowed tokens (structured outputs), or None: a clear
    bit reads as logit -inf before temperature and every cutoff.
    num_splits / block_v / num_warps: launch shape (None = chosen from the shapes and the
    device).
    """
    B, V = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(B, dtype=torch.int32, device=logits.device)
    if B == 0:
        return out
    if block_v is None:
        # chunks of 1024 with 4 warps: 1-20% faster than 2048 with 8 at 8-256 rows, greedy
        # and sampled (benchmarks/bench_sampler.py)
        block_v = min(1024, triton.next_power_of_2(V))
    n_chunks = triton.cdiv(V, block_v)
    if num_splits is None:
        # compute-bound (hash + logs): ~16 programs per SM; 8 splits of 2048-token chunks at
        # 256 or 128 rows of the 151,936 vocabulary beat 2 by 11-12% on the H200
        # (benchmarks/bench_sampler.py)
        target = 16 * sm_count(logits.device, cpu=1)
        num_splits = max(1, min(triton.cdiv(target, B), triton.cdiv(n_chunks, 4)))
    num_splits = max(1, min(num_splits, n_chunks))
    span = triton.cdiv(n_chunks, num_splits) * block_v
    num_splits = triton.cdiv(V, span)  # no empty split
    single = num_splits == 1
    if single:
        part_val = part_idx = out  # unused
    else:
        part_val = torch.empty(B, num_splits, dtype=torch.float32, device=logits.device)
        part_idx = torch.empty(B, num_splits, dtype=torch.int32, device=logits.device)
    has_cutoff = cutoff is not None
    if num_warps is None:
        num_warps = 8 if block_v >= 2048 else 4  # 8 warps for 1024: 3-5% slower at 32-256 sampled rows
    has_mask = bitmask is not None
    if has_mask and (bitmask.dtype != torch.int32 or bitmask.shape[0] != B or bitmask.stride(1) != 1
                     or bitmask.shape[1] * 32 < V):
        raise ValueError(f"bitmask must be int32 [{B}, >= {triton.cdiv(V, 32)}] with contiguous rows, "
                         f"got {bitmask.dtype} {tuple(bitmask.shape)}")
    pdl = pdl_launch(logits.device)
    _sample_kernel[(B, num_splits)](
        logits, logits.stride(0), V, span,
        temperature, inv_t, cutoff if has_cutoff else inv_t, log_min_p, seed, token_index,
        part_val, part_idx, out,
        num_splits, bitmask if has_mask else out, bitmask.stride(0) if has_mask else 0,
        HAS_MASK=has_mask, HAS_CUTOFF=has_cutoff, SINGLE=single, BLOCK_V=block_v, num_warps=num_warps,
        **pdl,
    )
    if not single:
        _reduce_splits_kernel[(B,)](part_val, part_idx, out, num_splits,
                                    BLOCK_S=triton.next_power_of_2(num_splits),
                                    num_warps=1, **pdl)
    return out


def _noise(seed: torch.Tensor, token_index: torch.Tensor, vocab_size: int, gumbel: bool) -> torch.Tensor:
    B = seed.shape[0]
    out = torch.empty(B, vocab_size, dtype=torch.float32 if gumbel else torch.int64, device=seed.device)
    if B == 0 or vocab_size == 0:
        return out
    block = min(1024, triton.next_power_of_2(vocab_size))
    _noise_kernel[(B, triton.cdiv(vocab_size, block))](
        seed.contiguous(), token_index.contiguous(), out, vocab_size, out.stride(0),
        GUMBEL=gumbel, BLOCK_V=block)
    return out


def random_bits_triton(seed: torch.Tensor, token_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The kernel's 32-bit hash of (seed, token_index, v) for v < vocab_size, as int64 [B, V]."""
    return _noise(seed, token_index, vocab_size, gumbel=False)


def gumbel_noise_triton(seed: torch.Tensor, token_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The kernel's Gumbel noise G(seed, token_index, v), float32 [B, V] (tests, debugging)."""
    return _noise(seed, token_index, vocab_size, gumbel=True)
