"""FP8-weight linear layers (`Fp8Weight`, slipstream/quant): the same operations as
ops/linear.py (product, residual add, a tensor-parallel rank's partial product, the folded
norm's product, SiLU·mul into the down product), with these paths:

- CPU (tests, CI): the reference. The weight is dequantized to the activation dtype and
  multiplied by the unquantized input (weight-only quantization: `fp8_linear_ref`).
- CUDA, one row (up to `Fp8GemvConfig.max_rows`, 1: at 2-16 rows the skinny GEMM below is
  faster; `SLIPSTREAM_GEMV` on, not batch-invariant): the FP8 GEMV (ops/triton_fp8_gemv.py)
  streams the FP8 weight and multiplies the unquantized input rows (on tensor cores in f16
  with fp32 sums); per-channel or block scales, the folded norm's gamma and row scale, the bias, SiLU·mul and
  the residual are applied inside it.
- CUDA, more rows: the input is quantized per token (per token and 128-column group for block
  weights; ops/triton_fp8_quant.py, gamma folded into that pass) and multiplied by the kernel
  that ops/fp8_dispatch.py's table routes the row count and weight layout to: `torch._scaled_mm`
  (cuBLASLt, row-wise scales), the skinny Triton GEMM (ops/triton_fp8_gemm_skinny.py, few
  rows), the Triton FP8 GEMM (ops/triton_fp8_gemm.py), or torch's block-scaled `_scaled_mm`.
  The Triton kernels add `fp8_linear_add_`'s residual in their epilogue (one rounding, as
  cuBLAS's beta = 1); after a `_scaled_mm` it is a separate add.
- CUDA, batch-invariant mode: every FP8 product takes the Triton FP8 GEMM.

Batch invariance: the Triton FP8 GEMM and the per-token quantization give a row the same bits
in any batch (one tile config for every M, no split over K); cuBLASLt picks its kernel from M
and the GEMV runs at one row only, so neither is used with `batch_invariant=True`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.quant.fp8 import Fp8Weight, quantize_per_token


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                   quantize_input: bool = False) -> torch.Tensor:
    """x [..., K] (times gamma) @ dequantize(w)^T (+ bias), in x's dtype. quantize_input: the
    input is first quantized per token (per token and K-block for block weights), as the GPU
    GEMMs do (their reference)."""
    x2 = x.reshape(-1, x.shape[-1])
    if w.gamma is not None:
        x2 = (x2.float() * w.gamma).to(x.dtype)
    if quantize_input:
        q, s = quantize_per_token(x2, w.block[1] if w.block else None)
        group = w.block[1] if w.block else x2.shape[1]
        x2 = (q.float() * s.repeat_interleave(group, 1)[:, :x2.shape[1]]).to(x.dtype)
    y = F.linear(x2, w.dequantized(x.dtype), bias)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _gemv_applies(x: torch.Tensor, batch_invariant: bool) -> bool:
    if batch_invariant or not x.is_cuda:
        return False
    from slipstream.ops.linear import GEMV_ENABLED
    from slipstream.ops.triton_fp8_gemv import DEFAULT_FP8_GEMV_CONFIG
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return GEMV_ENABLED and 0 < rows <= min(DEFAULT_FP8_GEMV_CONFIG.max_rows, 16)


def _routed_kernel(rows: int, w: Fp8Weight, batch_invariant: bool) -> str:
    """The kernel ops/fp8_dispatch.py routes `rows` rows of `w` to (the Triton FP8 GEMM, one
    tile config for every M, in batch-invariant mode)."""
    from slipstream.ops.fp8_dispatch import DISPATCH
    return "triton" if batch_invariant else DISPATCH.kernel_for(rows, w.block is not None)


def multiplies_unquantized(x: torch.Tensor, batch_invariant: bool = False) -> bool:
    """Whether `fp8_linear(x, w)` multiplies x as it is (its reference is `fp8_linear_ref`
    without `quantize_input`): on the CPU and at the one-row GEMV's rows; every other path
    quantizes the input per token first."""
    return not x.is_cuda or _gemv_applies(x, batch_invariant)


def _product(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, batch_invariant: bool) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) on CUDA by the routed kernel."""
    from slipstream.ops.fp8_dispatch import fp8_product
    return fp8_product(x, w, bias, _routed_kernel(x.shape[0], w, batch_invariant))


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               batch_invariant: bool = False) -> torch.Tensor:
    if not x.is_cuda:
        return fp8_linear_ref(x, w, bias)
    if _gemv_applies(x, batch_invariant):
        from slipstream.ops.triton_fp8_gemv import fp8_gemv
        return fp8_gemv(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    return _product(x2, w, bias, batch_invariant).reshape(*x.shape[:-1], w.shape[0])


def fp8_linear_add_(out: torch.Tensor, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                    batch_invariant: bool = False) -> torch.Tensor:
    """out += x W^T (+ b), in place; returns out."""
    if _gemv_applies(x, batch_invariant) and out.is_contiguous():
        from slipstream.ops.triton_fp8_gemv import fp8_gemv
        return fp8_gemv(x, w, bias, residual=out, out=out)
    if x.is_cuda and out.dim() == 2 and out.stride(1) == 1:
        from slipstream.ops.fp8_dispatch import adds_residual, fp8_product
        x2 = x.reshape(-1, x.shape[-1])
        kernel = _routed_kernel(x2.shape[0], w, batch_invariant)
        if adds_residual(kernel):  # the residual added in its epilogue
            return fp8_product(x2, w, bias, kernel, residual=out, out=out)
    return out.add_(fp8_linear(x, w, bias, batch_invariant))


def fp8_linear_into_(out: torch.Tensor, x: torch.Tensor, w: Fp8Weight, batch_invariant: bool = False) -> torch.Tensor:
    """out = x W^T (a tensor-parallel rank's partial product)."""
    if _gemv_applies(x, batch_invariant) and out.is_contiguous():
        from slipstream.ops.triton_fp8_gemv import fp8_gemv
        return fp8_gemv(x, w, out=out)
    return out.copy_(fp8_linear(x, w, None, batch_invariant))


def fp8_norm_linear(h: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, eps: float,
                    batch_invariant: bool = False) -> tuple[torch.Tensor, bool]:
    """`ops.linear.norm_linear` for an FP8 weight whose norm weight is its gamma: (y, finished)."""
    if _gemv_applies(h, batch_invariant):
        from slipstream.ops.triton_fp8_gemv import fp8_gemv
        return fp8_gemv(h, w, bias, row_scale_eps=eps), True
    return fp8_linear(h, w, None, batch_invariant), False


def fp8_silu_mul_linear_add_(out: torch.Tensor, gate_up: torch.Tensor, w: Fp8Weight,
                             hidden: torch.Tensor | None = None, eps: float = 1e-6,
                             batch_invariant: bool = False) -> torch.Tensor:
    """out += silu_and_mul(gate_up, hidden, eps) W^T, in place: SiLU·mul inside the GEMV at its
    rows (one) with gate_up finished, else inside the input's per-token quantization."""
    if hidden is None and _gemv_applies(gate_up, batch_invariant) and out.is_contiguous():
        from slipstream.ops.triton_fp8_gemv import fp8_gemv
        return fp8_gemv(gate_up, w, residual=out, out=out, silu_mul=True)
    if gate_up.is_cuda and gate_up.dim() == 2 and out.dim() == 2 and out.stride(1) == 1:
        # SiLU·mul inside the input's quantization (ops/triton_fp8_quant.py): the same bits
        from slipstream.ops.fp8_dispatch import adds_residual, fp8_product
        from slipstream.ops.triton_fp8_quant import SiluMulRows
        rows = SiluMulRows(gate_up, hidden, eps)
        kernel = _routed_kernel(rows.shape[0], w, batch_invariant)
        if adds_residual(kernel):
            return fp8_product(rows, w, None, kernel, residual=out, out=out)
        return out.add_(fp8_product(rows, w, None, kernel))
    from slipstream.ops.fused import silu_and_mul
    return fp8_linear_add_(out, silu_and_mul(gate_up, hidden=hidden, eps=eps), w, None, batch_invariant)
