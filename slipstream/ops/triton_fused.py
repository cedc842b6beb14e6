"""Triton kernels for the element-wise ops of the decoder: RMSNorm (+ residual), RoPE, SiLU·mul.

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
- `rope_triton` rotates q and k IN PLACE (any strides: they may be views into a fused
  qkv buffer) and returns them.
- `silu_and_mul_triton` writes a new tensor (or `out=`).
- `qkv_epilogue_triton` (q/k RMSNorm + RoPE + paged KV store in one launch) writes the
  rotated q IN PLACE into the q part of `qkv` by default and returns a strided view
  [T, Hq, D] of it (or writes into `out=`); k and v go to the cache only.

All launches depend only on shapes (no host syncs), so they are CUDA-graph safe. Under
`TRITON_INTERPRET=1` the same kernels run on CPU tensors (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "rms_norm_triton",
    "fused_add_rms_norm_triton",
    "rope_triton",
    "silu_and_mul_triton",
    "qkv_epilogue_triton",
]


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, n_cols,
    stride_x, stride_res, stride_out, stride_res_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
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


# ----------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_heads(base_ptr, stride_h, stride_d, h0, n_heads, cos, sin,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (h < n_heads)[:, None] & (d < HALF)[None, :]
    p1 = base_ptr + h[:, None].to(tl.int64) * stride_h + d[None, :].to(tl.int64) * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = x1f * cos[None, :] - x2f * sin[None, :]
    o2 = x2f * cos[None, :] + x1f * sin[None, :]
    tl.store(p1, o1.to(x1.dtype), mask=mask)
    tl.store(p2, o2.to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_cs,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # grid: (tokens, q head blocks + k head blocks)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d)
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if hb < n_q_blocks:
        _rope_heads(q_ptr + t * stride_qt, stride_qh, stride_qd, hb * BLOCK_H, n_q_heads,
                    cos, sin, HALF, BLOCK_H)
    else:
        _rope_heads(k_ptr + t * stride_kt, stride_kh, stride_kd, (hb - n_q_blocks) * BLOCK_H,
                    n_k_heads, cos, sin, HALF, BLOCK_H)


def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE of q [T, Hq, D] and k [T, Hk, D], IN PLACE (any strides).

    positions: int [T]; cos_sin_cache: float32 [max_position, D] (cos | sin), as in
    `rope_ref`. Returns (q, k), the same tensors, rotated.
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError("rope_triton expects q [T, Hq, D] and k [T, Hk, D]")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if d % 2 or (d & (d - 1)):
        raise ValueError(f"head dim must be an even power of two, got {d}")
    if cos_sin_cache.shape[-1] != d:
        raise ValueError(f"cos_sin_cache last dim {cos_sin_cache.shape[-1]} != head dim {d}")
    hk = k.shape[1]
    if t == 0:
        return q, k
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    pos = positions if positions.is_contiguous() else positions.contiguous()
    half = d // 2
    block_h = max(1, min(16, 2048 // half, triton.next_power_of_2(max(hq, hk))))
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))
    num_warps = 4 if block_h * half >= 1024 else (2 if block_h * half >= 256 else 1)
    _rope_kernel[grid](
        q, k, pos, cs,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        cs.stride(0),
        hq, hk,
        HALF=half, BLOCK_H=block_h, num_warps=num_warps,
    )
    return q, k


# ----------------------------------------------------------------------------- SiLU * mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_inter, stride_x, stride_out, BLOCK: tl.constexpr):
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
                               BLOCK=block, num_warps=num_warps)
    return out


# ----------------------------------------------------------------------------- qkv epilogue
#
# Everything between the qkv GEMM and attention in one launch: per-head RMSNorm of q and k
# (optional), neox RoPE of q and k, and the store of k and v into the paged cache.
#
# Grid: (tokens, head blocks).  The head blocks of a token are ceil(Hq / BLOCK_H) q blocks,
# then ceil(Hk / BLOCK_H) k blocks, then as many v blocks; every program handles BLOCK_H
# heads of one kind, so the branch is uniform per program.  A head is loaded as its two
# rotary halves [BLOCK_H, D/2] (x1 = d < D/2, x2 = d >= D/2): RoPE pairs (j, j + D/2) are then
# element-wise, and the RMS statistic is sum(x1^2) + sum(x2^2) -- no shuffles.
# Rounding follows `qkv_epilogue_ref` step by step: normalised value -> input dtype, times
# the weight -> the norm's result dtype (promote(weight, input)), RoPE in float32 -> that
# dtype once, then -> the cache dtype for k (a no-op when they agree).


@triton.jit
def _epi_norm_rope(x_ptrs, mask, w_ptr, cos, sin, eps,
                   HALF: tl.constexpr, HAS_NORM: tl.constexpr, MID_FP32: tl.constexpr):
    """Loads [BLOCK_H, HALF] x 2 halves at x_ptrs / x_ptrs + HALF; returns the rotated halves
    in float32 (not yet rounded to the output dtype) and the input's dtype carrier."""
    x1 = tl.load(x_ptrs, mask=mask, other=0.0)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if HAS_NORM:
        d = tl.arange(0, HALF)
        ss = tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)
        rstd = tl.rsqrt(ss / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        # normalised value rounded to the input dtype, then times the weight (rms_norm_ref)
        x1f = (x1f * rstd[:, None]).to(x1.dtype).to(tl.float32) * w1[None, :]
        x2f = (x2f * rstd[:, None]).to(x1.dtype).to(tl.float32) * w2[None, :]
        if not MID_FP32:  # the norm's result dtype is the input's: round the product to it
            x1f = x1f.to(x1.dtype).to(tl.float32)
            x2f = x2f.to(x1.dtype).to(tl.float32)
    o1 = x1f * cos[None, :] - x2f * sin[None, :]
    o2 = x2f * cos[None, :] + x1f * sin[None, :]
    return o1, o2, x1


@triton.jit
def _epi_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF: tl.constexpr):
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d).to(tl.float32)
    return cos, sin


@triton.jit
def _epi_q(row, pos_ptr, cs_ptr, w_ptr, out_ptr, t, h0, n_q_heads, eps,
           stride_cs, stride_ot, stride_oh,
           HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
           MID_FP32: tl.constexpr):
    cos, sin = _epi_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF)
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (h < n_q_heads)[:, None] & (d < HALF)[None, :]
    x_ptrs = row + h[:, None] * (2 * HALF) + d[None, :]
    o1, o2, x1 = _epi_norm_rope(x_ptrs, mask, w_ptr, cos, sin, eps, HALF, HAS_NORM, MID_FP32)
    # out's dtype is the norm's result dtype (rope_ref rounds to it once)
    o_ptrs = out_ptr + t * stride_ot + h[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(o_ptrs, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptrs + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epi_k(row, pos_ptr, cs_ptr, w_ptr, slot_ptr, cache_ptr, t, h0, n_q_heads, n_kv_heads, eps,
           stride_cs, stride_cb, stride_cs_slot, stride_ch,
           HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           HAS_NORM: tl.constexpr, MID_FP32: tl.constexpr):
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cos, sin = _epi_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF)
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    # (slot broadcast before the compare: Triton's interpreter turns `tensor & scalar bool`
    # into integers, which tl.load rejects as a mask)
    mask = ((h < n_kv_heads) & (h * 0 + slot >= 0))[:, None] & (d < HALF)[None, :]
    slot = tl.maximum(slot, 0)
    x_ptrs = row + (n_q_heads + h[:, None]) * (2 * HALF) + d[None, :]
    o1, o2, x1 = _epi_norm_rope(x_ptrs, mask, w_ptr, cos, sin, eps, HALF, HAS_NORM, MID_FP32)
    if not MID_FP32:  # rope_ref's rounding to the input dtype, then the cache's dtype
        o1 = o1.to(x1.dtype)
        o2 = o2.to(x1.dtype)
    c_ptrs = (cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs_slot
              + h[:, None].to(tl.int64) * stride_ch + d[None, :])
    tl.store(c_ptrs, o1.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptrs + HALF, o2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epi_v(row, slot_ptr, cache_ptr, t, h0, n_q_heads, n_kv_heads,
           stride_cb, stride_cs_slot, stride_ch,
           HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    mask = ((h < n_kv_heads) & (h * 0 + slot >= 0))[:, None] & (d < HEAD_DIM)[None, :]
    slot = tl.maximum(slot, 0)
    v = tl.load(row + (n_q_heads + n_kv_heads + h[:, None]) * HEAD_DIM + d[None, :],
                mask=mask, other=0.0)
    c_ptrs = (cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs_slot
              + h[:, None].to(tl.int64) * stride_ch + d[None, :])
    tl.store(c_ptrs, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_epilogue_kernel(
    qkv_ptr, pos_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, qw_ptr, kw_ptr, q_out_ptr,
    stride_t, stride_cs, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    n_q_heads, n_kv_heads, eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    Q_NORM: tl.constexpr,
    K_NORM: tl.constexpr,
    Q_MID_FP32: tl.constexpr,
    K_MID_FP32: tl.constexpr,
):
    # grid: (tokens, q head blocks + k head blocks + v head blocks); each branch is a
    # helper so that no value escapes an `if` (its types differ between branches)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    n_qb = tl.cdiv(n_q_heads, BLOCK_H)
    n_kb = tl.cdiv(n_kv_heads, BLOCK_H)
    row = qkv_ptr + t * stride_t
    if hb < n_qb:
        _epi_q(row, pos_ptr, cs_ptr, qw_ptr, q_out_ptr, t, hb * BLOCK_H, n_q_heads, eps,
               stride_cs, stride_ot, stride_oh,
               HALF, BLOCK_H, Q_NORM, Q_MID_FP32)
    elif hb < n_qb + n_kb:
        _epi_k(row, pos_ptr, cs_ptr, kw_ptr, slot_ptr, k_cache_ptr, t, (hb - n_qb) * BLOCK_H,
               n_q_heads, n_kv_heads, eps,
               stride_cs, stride_kcb, stride_kcs, stride_kch,
               HALF, BLOCK_H, BLOCK_SIZE, K_NORM, K_MID_FP32)
    else:
        _epi_v(row, slot_ptr, v_cache_ptr, t, (hb - n_qb - n_kb) * BLOCK_H, n_q_heads, n_kv_heads,
               stride_vcb, stride_vcs, stride_vch,
               2 * HALF, BLOCK_H, BLOCK_SIZE)


def _epilogue_block_h(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Heads per program: blocks of up to 2048 elements, shrunk (down to 512 elements) while
    the grid has fewer than ~1024 programs, so that small decode batches still spread over
    all SMs and prefill gets programs big enough to amortise their fixed cost."""
    bh = max(1, min(triton.next_power_of_2(max(num_heads, num_kv_heads)), 2048 // head_dim))

    def n_programs(b):
        return num_tokens * (triton.cdiv(num_heads, b) + 2 * triton.cdiv(num_kv_heads, b))

    while bh > 1 and bh * head_dim > 512 and n_programs(bh) < 1024:
        bh //= 2
    return bh


def qkv_epilogue_triton(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_heads: int, num_kv_heads: int, head_dim: int,
                        q_norm_weight: torch.Tensor | None = None,
                        k_norm_weight: torch.Tensor | None = None,
                        eps: float = 1e-6, *,
                        out: torch.Tensor | None = None,
                        block_h: int | None = None,
                        num_warps: int | None = None) -> torch.Tensor:
    """`qkv_epilogue_ref` in one kernel launch; returns q [T, num_heads, head_dim].

    qkv: [T, (Hq + 2 Hk) * D] with a contiguous last dim (any row stride).
    positions / slot_mapping: int32 or int64, at least T entries (the first T are used).
    k_cache / v_cache: [num_blocks, block_size, Hk, D], head_dim contiguous.
    By default q is written IN PLACE into the q columns of qkv and the returned tensor is a
    view of qkv with strides (qkv.stride(0), D, 1); when the result dtype differs from
    qkv's (a float32 norm weight with half inputs) a new tensor is allocated instead.
    `out=` ([T, Hq, D], last dim contiguous) writes q there.  `block_h` / `num_warps`
    override the launch heuristic (benchmarks).  No host syncs: CUDA-graph capturable.
    """
    num_tokens = qkv.shape[0]
    D = head_dim
    if D < 2 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two, got {D}")
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * num_kv_heads) * D}], got {tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError("qkv must have a contiguous last dimension")
    if cos_sin_cache.shape[-1] != D:
        raise ValueError(f"cos_sin_cache last dim {cos_sin_cache.shape[-1]} != head_dim {D}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, D):
        raise ValueError(f"caches must be [blocks, block_size, {num_kv_heads}, {D}], "
                         f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous")
    block_size = k_cache.shape[1]
    if positions.shape[0] < num_tokens or slot_mapping.shape[0] < num_tokens:
        raise ValueError("positions / slot_mapping shorter than qkv")
    q_norm = q_norm_weight is not None
    k_norm = k_norm_weight is not None
    q_dtype = torch.promote_types(q_norm_weight.dtype, qkv.dtype) if q_norm else qkv.dtype
    q_mid_fp32 = q_dtype == torch.float32
    k_mid_fp32 = k_norm and torch.promote_types(k_norm_weight.dtype, qkv.dtype) == torch.float32
    if out is None:
        if q_dtype == qkv.dtype:
            out = qkv[:, : num_heads * D].view(num_tokens, num_heads, D)
        else:
            out = torch.empty((num_tokens, num_heads, D), dtype=q_dtype, device=qkv.device)
    elif tuple(out.shape) != (num_tokens, num_heads, D) or out.dtype != q_dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {q_dtype} [{num_tokens}, {num_heads}, {D}] with a "
                         f"contiguous last dim, got {out.dtype} {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    for w, name in ((q_norm_weight, "q_norm_weight"), (k_norm_weight, "k_norm_weight")):
        if w is not None and (w.shape != (D,) or w.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{D}] tensor")
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    pos = positions if positions.is_contiguous() else positions.contiguous()
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    bh = block_h or _epilogue_block_h(num_tokens, num_heads, num_kv_heads, D)
    if num_warps is None:
        num_warps = max(1, min(8, bh * D // 512))
    grid = (num_tokens, triton.cdiv(num_heads, bh) + 2 * triton.cdiv(num_kv_heads, bh))
    _qkv_epilogue_kernel[grid](
        qkv, pos, cs, k_cache, v_cache, slots,
        q_norm_weight if q_norm else qkv, k_norm_weight if k_norm else qkv, out,
        qkv.stride(0), cs.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, num_kv_heads, float(eps),
        HALF=D // 2, BLOCK_H=bh, BLOCK_SIZE=block_size,
        Q_NORM=q_norm, K_NORM=k_norm, Q_MID_FP32=q_mid_fp32, K_MID_FP32=k_mid_fp32,
        num_warps=num_warps,
        # no FMA contraction: the products and sums are rounded like the torch reference's
        enable_fp_fusion=False,
    )
    return out
