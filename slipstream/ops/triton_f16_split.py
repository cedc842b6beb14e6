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

Each program scales per (row, warp slice of a K tile): `slice_scales` takes the largest
magnitude of the slice's values, computed in registers from the tile the product loads
anyway, so no pass over the input comes before the first product (an earlier form read the
row's range in a pass after the PDL wait: one trip to L2 before each program's first MMA),
and each slice keeps 22 bits relative to its own largest value, not the row's. `row_scales`
turns amax into the scale and its inverse by exponent arithmetic; `split_f16` makes the
parts. The reference is plain fp32 (tests/test_fp8_gemv_range.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def slice_scales(v):
    """(scale, inverse) [A, C] of v [A, B, C] fp32: powers of two from each (a, c)'s largest
    |v| over B (a warp's K slice of a row), `row_scales` of it."""
    return row_scales(tl.max(tl.abs(v), axis=1))


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
