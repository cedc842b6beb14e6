"""Triton kernels for the element-wise ops of the decoder: RMSNorm, SiLU·mul (with the row
scale of a folded norm), and `row_rstd`, the RMS statistic the kernels after a folded
norm's GEMM compute. (RoPE is fused with the q/k norm and the KV store:
`slipstream.ops.triton_qkv_epilogue`.)

Their semantics are those of the pure-torch references in `slipstream.ops.fused`
(statistics in float32, results rounded to the input dtype at the same points), so the
two agree up to float32 summation order (fp32: ~1e-6 relative; bf16: one bf16 ulp at most).
Both write a new tensor (or `out=`). All launches depend only on shapes (no host syncs),
so they are CUDA-graph safe. Under `TRITON_INTERPRET=1` the same kernels run on CPU
tensors (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start

__all__ = ["rms_norm_triton", "silu_and_mul_triton"]

ROW_BLOCK_MAX = 8192  # residual-stream rows up to this width are summed in one block


@triton.jit
def row_rstd(row_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    """1 / sqrt(mean(row^2) + eps) of one row of N elements, in float32 (`row_rstd_ref`).
    Callers issue their own loads first: the kernels after a GEMM are latency-bound at
    decode sizes, and this load then overlaps theirs. The squares are summed in float64,
    where a bf16 value's square is exact and the sum rounds 2^29 times finer than float32's
    last bit: the order the kernel's warps add in changes the float32 result only for a row
    whose sum lies that close to a float32 rounding boundary, so kernels launched with
    different warps (SiLU·mul's and the FP8 quantization's, fused or not) scale a row by the
    same bits."""
    if BLOCK >= N:  # one block: no loop, so the load is not held behind a loop boundary
        offs = tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < N, other=0.0).to(tl.float64)
        ss = tl.sum(x * x, axis=0)
    else:
        acc = tl.zeros([BLOCK], tl.float64)
        for start in range(0, N, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < N, other=0.0).to(tl.float64)
            acc += x * x
        ss = tl.sum(acc, axis=0)
    return tl.rsqrt(ss.to(tl.float32) / N + eps)


def row_block(n: int) -> int:
    """BLOCK of `row_rstd` for rows of n elements (the whole row up to 8192)."""
    return min(triton.next_power_of_2(max(n, 1)), ROW_BLOCK_MAX)


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit(do_not_specialize=["n_rows"])  # varies per step: no recompiles
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    n_rows, n_cols,
    stride_x, stride_out,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # One program normalises BLOCK_M whole rows (BLOCK_N >= n_cols): every row is read
    # completely before anything is written, so out may alias x.
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / n_cols
    rstd = tl.rsqrt(var + eps)
    # normalised value rounded to the input dtype, then times the weight (reference order)
    y = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = y * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> a 2-D view [R, N] with unit stride in the last dim (copy only if needed)."""
    n = t.shape[-1]
    t2 = t.reshape(-1, n)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _check_out(out: torch.Tensor, shape, dtype, name: str) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {tuple(shape)}, got {out.dtype} {tuple(out.shape)}")


def _as_rows_out(out: torch.Tensor, n_cols: int, name: str) -> torch.Tensor:
    o2 = out.view(-1, n_cols)  # raises if `out` cannot be viewed as rows
    if o2.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension")
    return o2


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * rms_norm(x) over the last dim; same dtype rules as `rms_norm_ref`."""
    n = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    else:
        _check_out(out, x.shape, out_dtype, "out")
    x2 = _rows_2d(x)
    o2 = _as_rows_out(out, n, "out")
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out
    block_n = triton.next_power_of_2(max(n, 1))
    # several rows per program for small hidden sizes, one row for the big ones
    block_m = max(1, min(16, 2048 // block_n))
    num_warps = max(1, min(16, (block_m * block_n) // 512))
    _rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
        x2, weight.contiguous(), o2, n_rows, n, x2.stride(0), o2.stride(0), float(eps),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **pdl_launch(x2.device),
    )
    return out


# ----------------------------------------------------------------------------- SiLU * mul


@triton.jit
def silu_mul(g, u):
    """silu(g) * u in float32 (`silu_and_mul_ref`); also the down GEMV's input (triton_gemv.py)."""
    g = g.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, h_ptr, out_ptr, n_inter, stride_x, stride_h, stride_out, eps,
                         N_HIDDEN: tl.constexpr, BLOCK: tl.constexpr, BLOCK_HID: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    if N_HIDDEN > 0:  # the folded post-attention norm's statistic (silu_and_mul_ref)
        r = row_rstd(h_ptr + row * stride_h, eps, N_HIDDEN, BLOCK_HID)
        g = g * r
        u = u * r
    y = silu_mul(g, u)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, hidden: torch.Tensor | None = None, eps: float = 1e-6,
                        out: torch.Tensor | None = None, block: int | None = None,
                        num_warps: int | None = None) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up, [..., I] (same dtype as x).

    hidden [..., H]: the residual stream the gate_up GEMM read (its norm folded into the
    GEMM); gate and up are scaled by its rows' rstd first (`silu_and_mul_ref`)."""
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"last dim must be even, got {two_i}")
    inter = two_i // 2
    out_shape = (*x.shape[:-1], inter)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, out_shape, x.dtype, "out")
    x2 = _rows_2d(x)
    o2 = _as_rows_out(out, inter, "out")
    n_rows = x2.shape[0]
    if hidden is not None and hidden.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must have x's rows {tuple(x.shape[:-1])}")
    h2 = _rows_2d(hidden) if hidden is not None else x2
    if n_rows == 0 or inter == 0:
        return out
    n_hidden = h2.shape[-1] if hidden is not None else 0  # 0: no row scale
    block = block or min(1024, triton.next_power_of_2(inter))  # block / num_warps: benchmarks
    num_warps = num_warps or (4 if block >= 1024 else (2 if block >= 256 else 1))
    grid = (n_rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, h2, o2, inter, x2.stride(0), h2.stride(0), o2.stride(0),
                               float(eps), N_HIDDEN=n_hidden, BLOCK=block,
                               BLOCK_HID=row_block(n_hidden),
                               num_warps=num_warps, **pdl_launch(x.device))
    return out
