"""Triton kernels for the element-wise ops of the decoder: RMSNorm (+ residual), SiLU·mul.
(RoPE is fused with the q/k norm and the KV store: `slipstream.ops.triton_qkv_epilogue`.)

Their semantics are those of the pure-torch references in `slipstream.ops.fused`
(statistics in float32, results rounded to the input dtype at the same points), so the
two agree up to float32 summation order (fp32: ~1e-6 relative; bf16: one bf16 ulp at most).

Buffers:
- `rms_norm_triton` writes a new tensor (or `out=`).
- `fused_add_rms_norm_triton` by default works IN PLACE: the sum x + residual is written
  into `residual` and the normalised output into `x`, and both are returned. Callers must
  use the returned tensors and must not rely on the old contents of `x`/`residual`.
  In place is skipped (fresh tensors are allocated) where it cannot hold: a dtype that
  differs from the result's, or a buffer whose last dimension is not contiguous.
  Pass `inplace=False`, or `out=` / `residual_out=`, to write elsewhere.
- `silu_and_mul_triton` writes a new tensor (or `out=`).

All launches depend only on shapes (no host syncs), so they are CUDA-graph safe. Under
`TRITON_INTERPRET=1` the same kernels run on CPU tensors (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start

__all__ = [
    "rms_norm_triton",
    "fused_add_rms_norm_triton",
    "silu_and_mul_triton",
]


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit(do_not_specialize=["n_rows"])  # varies per step: no recompiles
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, n_cols,
    stride_x, stride_res, stride_out, stride_res_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # One program normalises BLOCK_M whole rows (BLOCK_N >= n_cols): every row is read
    # completely before anything is written, so out / res_out may alias x / residual.
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        # the sum is rounded to the input dtype, then normalised (as the reference does)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :],
                 s.to(res_out_ptr.dtype.element_ty), mask=mask)
        xf = s.to(tl.float32)
    else:
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


def _norm_launch_params(n_cols: int) -> tuple[int, int, int]:
    block_n = triton.next_power_of_2(max(n_cols, 1))
    # several rows per program for small hidden sizes, one row for the big ones
    block_m = max(1, min(16, 2048 // block_n))
    num_warps = max(1, min(16, (block_m * block_n) // 512))
    return block_m, block_n, num_warps


def _launch_rms_norm(x2, r2, w, o2, ro2, eps: float) -> None:
    n_rows, n_cols = x2.shape
    if n_rows == 0:
        return
    block_m, block_n, num_warps = _norm_launch_params(n_cols)
    grid = (triton.cdiv(n_rows, block_m),)
    has_res = r2 is not None
    _rms_norm_kernel[grid](
        x2, r2 if has_res else x2, w, o2, ro2 if has_res else o2,
        n_rows, n_cols,
        x2.stride(0), r2.stride(0) if has_res else 0,
        o2.stride(0), ro2.stride(0) if has_res else 0,
        float(eps),
        HAS_RESIDUAL=has_res, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        **pdl_launch(x2.device),
    )


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
    w = weight.contiguous()
    _launch_rms_norm(x2, None, w, _as_rows_out(out, n, "out"), None, eps)
    return out


def _can_write_into(buf: torch.Tensor, dtype: torch.dtype) -> bool:
    if buf.dtype != dtype:
        return False
    try:
        b2 = buf.view(-1, buf.shape[-1])
    except RuntimeError:
        return False
    return b2.stride(-1) == 1


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, *, inplace: bool = True,
                              out: torch.Tensor | None = None,
                              residual_out: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual) in one pass.

    By default writes the sum into `residual` and the output into `x` (see module doc);
    use the returned tensors.
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    n = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    res_dtype = x.dtype
    if out is None:
        out = x if (inplace and _can_write_into(x, out_dtype)) else \
            torch.empty(x.shape, dtype=out_dtype, device=x.device)
    else:
        _check_out(out, x.shape, out_dtype, "out")
    if residual_out is None:
        residual_out = residual if (inplace and _can_write_into(residual, res_dtype)) else \
            torch.empty(x.shape, dtype=res_dtype, device=x.device)
    else:
        _check_out(residual_out, x.shape, res_dtype, "residual_out")
    x2 = _rows_2d(x)
    r2 = _rows_2d(residual)
    w = weight.contiguous()
    _launch_rms_norm(x2, r2, w, _as_rows_out(out, n, "out"),
                     _as_rows_out(residual_out, n, "residual_out"), eps)
    return out, residual_out


# ----------------------------------------------------------------------------- SiLU * mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_inter, stride_x, stride_out, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    y = silu * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up, [..., I] (same dtype as x)."""
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
    if n_rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    num_warps = 4 if block >= 1024 else (2 if block >= 256 else 1)
    grid = (n_rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, o2, inter, x2.stride(0), o2.stride(0),
                               BLOCK=block, num_warps=num_warps, **pdl_launch(x.device))
    return out
