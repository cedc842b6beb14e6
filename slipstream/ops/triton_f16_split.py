"""An activation row in two f16 parts, for products on f16 tensor cores that keep the fp32
input's precision over bf16's whole range (the FP8 GEMV's input, ops/triton_fp8_gemv_mma.py).

Why a per-row scale: f16 holds normal values from 2^-14 to 65504 only, bf16 activations
span far more (a row of 1e-6, spikes of 1e6 or 1e9 beside O(1) values), and f16 subnormals
are best kept out of the tensor cores' inputs, whose handling of them is the hardware's
business. So each row is multiplied by a power of two, `scale`, that brings its largest
magnitude into [2^13, 2^14) (exact: only the exponent moves), then split:

    u = v * scale,  hi = f16(u),  lo = f16(u - hi)       (u - hi is exact in fp32)

and the product is y = (acc_hi + acc_lo) / scale, the division exact too. hi keeps 11
significant bits and lo the next 11, so a value is kept to 2^-22 of itself (bf16 inputs
have 8 bits: exactly, for gamma 1), and no part overflows (|hi| <= 2^14, |lo| <= 4). The
parts are normal f16 down to 2^-14, that is down to amax x 2^-27 in the row's units: smaller
values and remainders, were the tensor cores to flush them, would cost at most amax x 2^-26
each (two parts), far below the bf16 output's rounding.

`row_amax` reads the rows once before the product: the largest |x * gamma| of the columns a
program multiplies (split-K slices each take their own), or for a SiLU·mul input the bound
|silu(g) x up| <= min(|g|, max(g, 0.28)) x |up| (silu(g) <= g above zero, and below zero
|silu(g)| <= |g| / 2 and <= 0.2785), no exponential. The bound is within a factor of two of
the truth for any row with one gate above 0.28 or all gates near zero; a row whose gates
are all far below zero (silu(-30) ~ -3e-12 against the bound's 0.28) is then kept to 2^-26
of the bound absolutely, far below the rounding of the residual that the down product adds
into. `row_scales` turns amax into the scale and its inverse by exponent arithmetic;
`split_f16` makes the parts. The reference is plain fp32 (tests/test_fp8_gemv_range.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

# silu's minimum is -0.2785 (at g = -1.278): |silu(g)| <= 0.28 below zero
SILU_NEG_BOUND = tl.constexpr(0.28)


@triton.jit
def row_amax(x_ptr, g_ptr, offs_m, mmask, k0, k_end, stride_xm, K: tl.constexpr, CHUNK: tl.constexpr,
             GROUPS: tl.constexpr, UNROLL: tl.constexpr, SILU_MUL: tl.constexpr, HAS_GAMMA: tl.constexpr):
    """[M_PAD] fp32: each row's largest |x * gamma| over columns k0 .. k_end of x [M, K] (x is
    [gate | up] of width 2K when SILU_MUL: the bound min(|g|, max(g, 0.28)) x |up| instead); 0 for
    masked rows. GROUPS x UNROLL steps of CHUNK columns (covering k_end - k0), all rows at once,
    each group's steps unrolled: their loads are independent, so they are in flight together
    and a group costs about one trip to L2, not one a step (up to 8 steps a group bounds the
    code for long rows)."""
    offs_k = tl.arange(0, CHUNK)
    amax = tl.zeros([offs_m.shape[0], CHUNK], tl.float32)
    for g in range(GROUPS):
        for i in tl.static_range(UNROLL):
            amax = _amax_step(x_ptr, g_ptr, offs_m, mmask, k0 + (g * UNROLL + i) * CHUNK + offs_k, k_end,
                              stride_xm, amax, K, SILU_MUL, HAS_GAMMA)
    return tl.max(amax, axis=1)


@triton.jit
def _amax_step(x_ptr, g_ptr, offs_m, mmask, kk, k_end, stride_xm, amax, K: tl.constexpr, SILU_MUL: tl.constexpr,
               HAS_GAMMA: tl.constexpr):
    """amax after columns kk (those before k_end) of every row."""
    kmask = kk < k_end
    mask = mmask[:, None] & kmask[None, :]
    ptrs = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
    a = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        a = tl.minimum(tl.abs(a), tl.maximum(a, SILU_NEG_BOUND))
        a = a * tl.abs(tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32))
    else:
        a = tl.abs(a)
    if HAS_GAMMA:
        a = a * tl.abs(tl.load(g_ptr + kk, mask=kmask, other=0.0))[None, :]
    return tl.maximum(amax, a)


@triton.jit
def row_scales(amax):
    """(scale, inverse), powers of two from amax's exponent: amax x scale in [2^13, 2^14). A
    zero (or fp32-subnormal) amax takes 2^126, the largest that leaves the inverse normal."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax in [2^(e-127), 2^(e-126))
    s = tl.minimum(140 - e, 126)  # amax x 2^s in [2^13, 2^14); e = 255 (inf, nan): 2^-115
    scale = ((s + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - s) << 23).to(tl.float32, bitcast=True)
    return scale, inverse


@triton.jit
def split_f16(v, scale):
    """(hi, lo) f16 of v * scale (fp32, scale broadcast to v's shape): hi + lo = v * scale to
    2^-22 of itself."""
    u = v * scale
    hi = u.to(tl.float16)
    lo = (u - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


def prepass_steps(m_pad: int, k_per_split: int, silu_mul: bool) -> tuple[int, int, int]:
    """(columns a step, groups, steps a group) of `row_amax` over a program's k_per_split
    columns: ~2,048 values a step (1,024 for [gate | up], two loads a value), 16 per thread at
    4 warps; up to 8 steps a group."""
    per_step = (1024 if silu_mul else 2048) // m_pad
    chunk = max(16, min(per_step, triton.next_power_of_2(k_per_split)))
    steps = triton.cdiv(k_per_split, chunk)
    unroll = min(steps, 8)
    return chunk, triton.cdiv(steps, unroll), unroll
