"""`dot`: the kernels' matrix product, the same under Triton's CPU interpreter (the tests) as
on the GPU."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in float32 (acc None: the product alone). IEEE: float32 operands multiplied
    exactly, not as TF32. UPCAST: the interpreter cannot multiply bf16 (it multiplies the raw
    bits), so the operands go to float32, which holds their products exactly (`dot_flags` in
    ops/device.py says when)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
