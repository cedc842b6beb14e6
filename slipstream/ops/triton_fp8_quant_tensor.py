"""Per-tensor dynamic FP8 quantization of activations: x [M, K] to e4m3 with one float32 scale
for the whole tensor (amax / 448), what `torch._scaled_mm`'s tensor-wise kernel reads.

Two kernels: each row's amax into one float32 by an atomic max (amax >= 0, so float order is
integer order), then every row quantized by the common scale. The scale depends on every
row, so a row's result depends on the batch: not for batch-invariant mode. The reference is
`quant.fp8.quantize_per_tensor`; launches depend on shapes only (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.triton_fp8_quant import quantize_chunk, scale_from_amax
from slipstream.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE


@triton.jit
def _row_amax_kernel(x_ptr, amax_ptr, K, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    tl.atomic_max(amax_ptr, tl.max(amax, axis=0))


@triton.jit
def _quant_tensor_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr,
                         FMAX: tl.constexpr, SMIN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    scale = scale_from_amax(tl.load(amax_ptr), FMAX, SMIN)
    if row == 0:
        tl.store(s_ptr, scale)
    offs = tl.arange(0, BLOCK)
    for k in tl.range(0, K, BLOCK):
        mask = k + offs < K
        x = tl.load(x_ptr + row * stride_xm + k + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + k + offs, quantize_chunk(x, scale, FMAX).to(q_ptr.dtype.element_ty),
                 mask=mask)


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, K], scale float32 [1]) of x [M, K]."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    s = torch.empty(1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s.fill_(MIN_SCALE)
    block = min(triton.next_power_of_2(k), 2048)
    _row_amax_kernel[(m,)](x, amax, k, x.stride(0), BLOCK=block, num_warps=4)
    _quant_tensor_kernel[(m,)](x, amax, q, s, k, x.stride(0), q.stride(0), BLOCK=block, FMAX=FP8_MAX,
                               SMIN=MIN_SCALE, num_warps=4)
    return q, s
