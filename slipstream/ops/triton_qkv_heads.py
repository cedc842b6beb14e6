"""The per-head work between the qkv GEMM and attention as Triton device functions: the row
scale of a folded input norm and the qkv bias, per-head RMSNorm of q and k, neox RoPE, and
the store of k and v (bf16 or FP8) into the paged KV cache. Two kernels inline them: the
standalone epilogue (ops/triton_qkv_epilogue.py, a program per token and head block) and the
decode attention kernel, which runs a decode row's epilogue itself (`decode_epilogue`).

A head is loaded as its two rotary halves [BLOCK_H, D/2] (x1 = d < D/2, x2 = d >= D/2): RoPE
pairs (j, j + D/2) are then element-wise, and the RMS statistic is sum(x1^2) + sum(x2^2) -- no
shuffles. With a folded input norm every program first computes its token's rstd from the
residual stream row (2-8 KB, read from L2 by the token's few programs). Rounding follows
`ops.fused.qkv_epilogue_ref` step by step: GEMM output * rstd (+ bias) -> input dtype
(`scale_rows_ref`), normalised value -> input dtype, times the weight -> the norm's result
dtype (promote(weight, input)), RoPE in float32 -> that dtype once, then -> the cache dtype for
k (a no-op when they agree).
"""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.ops.triton_fused import row_rstd


@triton.jit
def _fp8_quant(x, inv_scale):
    """x in float32 times 1 / scale, saturated to e4m3's +-448 and rounded to nearest even
    e4m3 value here, in float32 (`kv_quant.quantize_ref`), so that the store's cast to the
    cache's float8 type is exact.  (Triton's interpreter rounds that cast wrongly where the
    mantissa carries into the exponent, 31.7 -> 16; a few integer operations a value in a
    kernel bound by its memory traffic.)"""
    y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # normal values: keep 3 of float32's 23 mantissa bits, ties to even (a carry moves the exponent)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # below 2^-6 (subnormal e4m3): multiples of 2^-9, rounded by float32's own addition at 2^14
    tiny = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, tiny, normal)
    return tl.where(y < 0, -r, r)


@triton.jit
def _epi_row_scale(h_row, eps, N_HIDDEN: tl.constexpr, BLOCK_HID: tl.constexpr):
    """rstd of the token's residual-stream row (folded input norm; N_HIDDEN = 0: none), else 1."""
    scale = tl.full([], 1.0, tl.float32)
    if N_HIDDEN > 0:
        scale = row_rstd(h_row, eps, N_HIDDEN, BLOCK_HID)
    return scale


@triton.jit
def _epi_finish(x, b_ptrs, mask, scale, PRE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The GEMM output finished (`scale_rows_ref`): x * rstd (+ bias), rounded to x's dtype."""
    if PRE:
        xf = x.to(tl.float32) * scale
        if HAS_BIAS:
            xf = xf + tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = xf.to(x.dtype)
    return x


@triton.jit
def _epi_norm_rope(row, cols, mask, bias_ptr, h_row, w_ptr, cos, sin, eps,
                   HALF: tl.constexpr, HAS_NORM: tl.constexpr, MID_FP32: tl.constexpr,
                   PRE: tl.constexpr, HAS_BIAS: tl.constexpr, N_HIDDEN: tl.constexpr,
                   BLOCK_HID: tl.constexpr):
    """Loads [BLOCK_H, HALF] x 2 halves at columns cols / cols + HALF of the row; returns the
    rotated halves in float32 (not yet rounded to the output dtype) and the input's dtype
    carrier. The row scale (from h_row) is loaded after x, so the two loads overlap."""
    x1 = tl.load(row + cols, mask=mask, other=0.0)
    x2 = tl.load(row + cols + HALF, mask=mask, other=0.0)
    scale = _epi_row_scale(h_row, eps, N_HIDDEN, BLOCK_HID)
    x1 = _epi_finish(x1, bias_ptr + cols, mask, scale, PRE, HAS_BIAS)
    x2 = _epi_finish(x2, bias_ptr + cols + HALF, mask, scale, PRE, HAS_BIAS)
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
def epi_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF: tl.constexpr):
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d).to(tl.float32)
    return cos, sin


@triton.jit
def epi_q(row, bias_ptr, h_row, pos_ptr, cs_ptr, w_ptr, out_ptr, t, h0, n_q_heads, eps,
           stride_cs, stride_ot, stride_oh, cos, sin,
           HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
           MID_FP32: tl.constexpr, PRE: tl.constexpr, HAS_BIAS: tl.constexpr,
           N_HIDDEN: tl.constexpr, BLOCK_HID: tl.constexpr, EARLY: tl.constexpr):
    if not EARLY:  # else cos / sin were loaded before the PDL wait
        cos, sin = epi_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF)
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (h < n_q_heads)[:, None] & (d < HALF)[None, :]
    cols = h[:, None] * (2 * HALF) + d[None, :]
    o1, o2, x1 = _epi_norm_rope(row, cols, mask, bias_ptr, h_row, w_ptr, cos, sin, eps,
                                HALF, HAS_NORM, MID_FP32, PRE, HAS_BIAS, N_HIDDEN, BLOCK_HID)
    # out's dtype is the norm's result dtype (rope_ref rounds to it once)
    o_ptrs = out_ptr + t * stride_ot + h[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(o_ptrs, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptrs + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def epi_k(row, bias_ptr, h_row, pos_ptr, cs_ptr, w_ptr, slot_ptr, cache_ptr, t, h0, n_q_heads,
           n_kv_heads, eps, stride_cs, stride_cb, stride_cs_slot, stride_ch, cos, sin, slot,
           HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           HAS_NORM: tl.constexpr, MID_FP32: tl.constexpr, PRE: tl.constexpr,
           HAS_BIAS: tl.constexpr, N_HIDDEN: tl.constexpr, BLOCK_HID: tl.constexpr,
           EARLY: tl.constexpr, inv_scale=None, KV_FP8: tl.constexpr = False):
    if not EARLY:  # else slot, cos and sin were loaded before the PDL wait
        slot = tl.load(slot_ptr + t).to(tl.int64)
        cos, sin = epi_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF)
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    # (slot broadcast before the compare: Triton's interpreter turns `tensor & scalar bool`
    # into integers, which tl.load rejects as a mask)
    mask = ((h < n_kv_heads) & (h * 0 + slot >= 0))[:, None] & (d < HALF)[None, :]
    slot = tl.maximum(slot, 0)
    cols = (n_q_heads + h[:, None]) * (2 * HALF) + d[None, :]
    o1, o2, x1 = _epi_norm_rope(row, cols, mask, bias_ptr, h_row, w_ptr, cos, sin, eps,
                                HALF, HAS_NORM, MID_FP32, PRE, HAS_BIAS, N_HIDDEN, BLOCK_HID)
    if not MID_FP32:  # rope_ref's rounding to the input dtype, then the cache's dtype
        o1 = o1.to(x1.dtype)
        o2 = o2.to(x1.dtype)
    if KV_FP8:
        o1 = _fp8_quant(o1, inv_scale)
        o2 = _fp8_quant(o2, inv_scale)
    c_ptrs = (cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs_slot
              + h[:, None].to(tl.int64) * stride_ch + d[None, :])
    tl.store(c_ptrs, o1.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptrs + HALF, o2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def epi_v(row, bias_ptr, h_row, slot_ptr, cache_ptr, t, h0, n_q_heads, n_kv_heads, eps,
           stride_cb, stride_cs_slot, stride_ch, slot,
           HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           PRE: tl.constexpr, HAS_BIAS: tl.constexpr, N_HIDDEN: tl.constexpr,
           BLOCK_HID: tl.constexpr, EARLY: tl.constexpr, inv_scale=None, KV_FP8: tl.constexpr = False):
    if not EARLY:  # else slot was loaded before the PDL wait
        slot = tl.load(slot_ptr + t).to(tl.int64)
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    mask = ((h < n_kv_heads) & (h * 0 + slot >= 0))[:, None] & (d < HEAD_DIM)[None, :]
    slot = tl.maximum(slot, 0)
    cols = (n_q_heads + n_kv_heads + h[:, None]) * HEAD_DIM + d[None, :]
    v = tl.load(row + cols, mask=mask, other=0.0)
    scale = _epi_row_scale(h_row, eps, N_HIDDEN, BLOCK_HID)
    v = _epi_finish(v, bias_ptr + cols, mask, scale, PRE, HAS_BIAS)
    if KV_FP8:
        v = _fp8_quant(v, inv_scale)
    c_ptrs = (cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs_slot
              + h[:, None].to(tl.int64) * stride_ch + d[None, :])
    tl.store(c_ptrs, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def decode_epilogue_inputs(pos_ptr, cs_ptr, slot_ptr, t, stride_cs, HALF: tl.constexpr):
    """Token t's rotary row (cos, sin) and cache slot: what the epilogue inside the decode
    kernel loads before its PDL wait (no kernel of a step writes them)."""
    cos, sin = epi_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF)
    return cos, sin, tl.load(slot_ptr + t).to(tl.int64)


@triton.jit
def decode_epilogue(row, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, cos, sin, slot, kvh, n_kv_heads, eps,
                    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stores,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
                    k_inv_scale=None, v_inv_scale=None, KV_FP8: tl.constexpr = False):
    """The qkv epilogue of one decode row for one KV head, inside the decode kernel's program
    (`triton_attention.decode_attention(epilogue=)`), for a finished qkv row (no row scale
    or bias left to apply): returns the program's rotated q heads [BLOCK_G, 2 * HALF] (rows
    >= GROUP zero) in qkv's dtype, computed by the same helpers as `epi_q`, so what that
    kernel stores; and, where `stores` (the program whose split holds the row's newest
    position), writes the row's K and V of head kvh into the cache as `epi_k` / `epi_v`
    do, then waits at a barrier so that the program's own tile loads after it read them.
    Only for norm dtypes equal to qkv's and a cache of qkv's dtype or FP8 (KV_FP8: k and v
    quantized with the reciprocal scales as `epi_k` / `epi_v` do; the host checks)."""
    n_q_heads = n_kv_heads * GROUP
    if stores:
        epi_k(row, row, row, row, row, kw_ptr, row, k_cache_ptr, 0, kvh, n_q_heads, n_kv_heads,
               eps, 0, stride_kcb, stride_kcs, stride_kch, cos, sin, slot,
               HALF, 1, BLOCK_SIZE, K_NORM, False, False, False, 0, 1, True, k_inv_scale, KV_FP8)
        epi_v(row, row, row, row, v_cache_ptr, 0, kvh, n_q_heads, n_kv_heads, eps,
               stride_vcb, stride_vcs, stride_vch, slot, 2 * HALF, 1, BLOCK_SIZE, False, False, 0, 1, True,
               v_inv_scale, KV_FP8)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HALF)
    mask = (g < GROUP)[:, None] & (d < HALF)[None, :]
    cols = (kvh * GROUP + g)[:, None] * (2 * HALF) + d[None, :]
    o1, o2, x1 = _epi_norm_rope(row, cols, mask, row, row, qw_ptr, cos, sin, eps,
                                HALF, Q_NORM, False, False, False, 0, 1)
    # [BLOCK_G, HALF] x 2 -> [BLOCK_G, 2 * HALF]: the halves side by side, as q sits in memory
    q = tl.reshape(tl.permute(tl.join(o1.to(x1.dtype), o2.to(x1.dtype)), (0, 2, 1)), (BLOCK_G, 2 * HALF))
    tl.debug_barrier()  # the K/V stores above are visible to every thread of this program
    return q
