"""Small-batch linear layers with FP8 weights on FP8 tensor cores: y[M, N] = (x * gamma)[M, K] @
(q * scale)[N, K]^T for M <= 16 rows, with the input kept to 2^-12 of itself (not quantized
to one e4m3 code a value as the GEMMs above 16 rows do).

Why: the f16 MMA kernel (ops/triton_fp8_gemv_mma.py) converts every weight byte to f16 in
registers (half an instruction a byte) and multiplies it with m16n8k16 MMAs: ~540 SASS
instructions a thread for each 64 KB tile at one row (sm_90), which a program issues between
its tile's arrival and the next tile's request. Here the weight tile goes from shared memory
straight into wgmma's e4m3 x e4m3 MMA (m64nXk32), untouched by the SM's threads; only the
input is prepared, as three e4m3 parts a value (ops/triton_f16_split.py `split_e4m3`): each
row is scaled by a power of two that brings its largest |x * gamma| into [2^7, 2^8), then
p1 = e4m3(v), p2 = e4m3(v - p1), p3 = e4m3(v - p1 - p2). The parts are the B operand's
columns (4 a row, the fourth zero: [BLOCK_K, 4 M_PAD]), the weight rows its M ("swap AB"), and
the row's product is the sum of its three columns over the scale. A value keeps 2^-12 of
itself (a bf16 input's 8 bits, for values above 2^-8 of the row's largest); what e4m3's
subnormal step loses is at most 2^-16 of the row's largest a value, far inside the weight's
own 2^-4.

The fp8 dot's sums move into the fp32 accumulator every 128 columns of K (Hopper keeps ~14
bits in the tensor cores' own). Per-channel scales multiply the finished sum; 128 x 128 block
weights take 128-wide K tiles, each tile's product times its block's scale. The rest is the
f16 MMA kernel's: the range pass (`row_amax`) after the PDL wait, the first weight tile loaded
before it, split-K through the same workspace and tickets (`finish`), the same epilogues
(folded norm's gamma, rstd, SiLU·mul, bias, residual). The reference is
`ops.fp8_linear.fp8_linear_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_f16_split import prepass_steps, row_amax, row_scales, split_e4m3
from slipstream.ops.triton_fp8_gemv_mma import finish, mma_shape, workspace
from slipstream.ops.triton_fused import silu_mul
from slipstream.quant.fp8 import Fp8Weight

E4M3_TOP = tl.constexpr(7)  # a row's largest scaled value in [2^7, 2^8): e4m3 holds up to 448


@triton.jit
def _input_parts(x_ptr, g_ptr, offs_m, kk, mmask, kmask, stride_xm, scale, K: tl.constexpr, M_PAD: tl.constexpr,
                 SILU_MUL: tl.constexpr, HAS_GAMMA: tl.constexpr):
    """The B operand of the K tile kk: [BLOCK_K, 4 M_PAD] e4m3, row m's parts in columns 4m ..
    4m + 2; and x^2 [BLOCK_K, M_PAD] fp32 for the row scale."""
    ptrs = x_ptr + offs_m[None, :] * stride_xm + kk[:, None]
    mask = kmask[:, None] & mmask[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        x = silu_mul(x, tl.load(ptrs + K, mask=mask, other=0.0)).to(x.dtype)
    xf = x.to(tl.float32)
    v = xf
    if HAS_GAMMA:
        v = xf * tl.load(g_ptr + kk, mask=kmask, other=0.0)[:, None]
    p1, p2, p3 = split_e4m3(v, scale[None, :])
    parts = tl.join(tl.join(p1, p2), tl.join(p3, tl.zeros_like(p3)))  # [BLOCK_K, M_PAD, 2, 2]
    return tl.reshape(parts, (kk.shape[0], 4 * M_PAD)).to(tl.float8e4nv), xf * xf


@triton.jit
def _tile(acc, sq, w, x_ptr, g_ptr, s_ptr, offs_n, offs_m, kk, k, nmask, mmask, stride_xm, stride_sn, scale,
          K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_K: tl.constexpr, ACC_K: tl.constexpr, BN_S: tl.constexpr,
          BLOCK_SCALES: tl.constexpr, SILU_MUL: tl.constexpr, HAS_GAMMA: tl.constexpr):
    """acc [BLOCK_N, 4 M_PAD] and sq after the weight tile w [BLOCK_N, BLOCK_K] at column k."""
    kmask = (kk + k) < K
    b, x2 = _input_parts(x_ptr, g_ptr, offs_m, kk + k, mmask, kmask, stride_xm, scale, K, M_PAD, SILU_MUL,
                         HAS_GAMMA)
    if BLOCK_SCALES:  # a tile is one scale block: its own dot, times the block's scales
        s = tl.load(s_ptr + (offs_n // BN_S) * stride_sn + k // BLOCK_K, mask=nmask, other=0.0)
        acc += tl.dot(w, b) * s[:, None]
    else:
        acc = tl.dot(w, b, acc, max_num_imprecise_acc=ACC_K)
    return acc, sq + x2


@triton.jit
def _weight_tile(ptrs, nmask, kmask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """[BLOCK_N, BLOCK_K] e4m3, unmasked where the shapes allow."""
    if EVEN_K and EVEN_N:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)


@triton.jit
def _fp8_gemv_wgmma_kernel(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, r_ptr, out_ptr, ws_ptr, sqws_ptr, ticket_ptr,
                           M, N, eps, k_per_split, stride_xm, stride_wn, stride_sn, stride_rm, stride_om,
                           K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           ACC_K: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                           BN_S: tl.constexpr, BLOCK_SCALES: tl.constexpr, HAS_GAMMA: tl.constexpr,
                           HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROW_SCALE: tl.constexpr,
                           SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr, PRE_K: tl.constexpr,
                           PRE_GROUPS: tl.constexpr, PRE_UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    kk = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    mmask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
    k0 = split * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    w0 = _weight_tile(w_ptrs + k0, nmask, (kk + k0) < K, EVEN_K, EVEN_N)  # no kernel writes weights
    pdl_start(USE_PDL)
    scale, inverse = row_scales(row_amax(x_ptr, g_ptr, offs_m, mmask, k0, k_end, stride_xm, K, PRE_K, PRE_GROUPS,
                                         PRE_UNROLL, SILU_MUL, HAS_GAMMA), E4M3_TOP)
    acc = tl.zeros([BLOCK_N, 4 * M_PAD], tl.float32)
    sq = tl.zeros([BLOCK_K, M_PAD], tl.float32)
    acc, sq = _tile(acc, sq, w0, x_ptr, g_ptr, s_ptr, offs_n, offs_m, kk, k0, nmask, mmask, stride_xm, stride_sn,
                    scale, K, M_PAD, BLOCK_K, ACC_K, BN_S, BLOCK_SCALES, SILU_MUL, HAS_GAMMA)
    for k in tl.range(k0 + BLOCK_K, k_end, BLOCK_K, num_stages=STAGES):
        w = _weight_tile(w_ptrs + k, nmask, (kk + k) < K, EVEN_K, EVEN_N)
        acc, sq = _tile(acc, sq, w, x_ptr, g_ptr, s_ptr, offs_n, offs_m, kk, k, nmask, mmask, stride_xm,
                        stride_sn, scale, K, M_PAD, BLOCK_K, ACC_K, BN_S, BLOCK_SCALES, SILU_MUL, HAS_GAMMA)
    y = tl.sum(tl.reshape(acc, (BLOCK_N, M_PAD, 4)), axis=2) * inverse[None, :]  # [BLOCK_N, M_PAD]
    finish(y, tl.sum(sq, axis=0), pid, split, ws_ptr, sqws_ptr, ticket_ptr, s_ptr, b_ptr, r_ptr, out_ptr, offs_n,
           offs_m, nmask, mmask, N, eps, stride_rm, stride_om, K, M_PAD, SPLIT, BLOCK_SCALES, HAS_BIAS, HAS_RES,
           ROW_SCALE)


def fp8_gemv_wgmma(x2: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, res2: torch.Tensor,
                   out2: torch.Tensor, *, has_res: bool, row_scale_eps: float | None, silu_mul: bool,
                   block_n: int | None, block_k: int, stages: int, num_warps: int, split: int | None,
                   sms: int, min_m_pad: int) -> None:
    """Launch over x2 [M, K or 2K] (M <= 16, unit stride along K) into out2 [M, N]; the
    arguments as `fp8_gemv_mma`'s (block_k: the K tile; block weights take their block's
    width); the rows padded to a power of two, at least min_m_pad (the dot's narrow side is
    4 x that: 16 columns at 4, the narrowest every Triton takes; wgmma takes 8)."""
    qw, scale, gamma, block = w.qweight, w.scale, w.gamma, w.block
    m = x2.shape[0]
    n, k = qw.shape
    m_pad = max(triton.next_power_of_2(m), min_m_pad)
    sh = mma_shape(n, k, block_n, block_k, 1, block, split, sms)
    ws = workspace(x2.device, n, sh.row_blocks, sh.split, m_pad) if sh.split > 1 else (out2, out2, out2)
    pre_k, pre_groups, pre_unroll = prepass_steps(m_pad, sh.k_per_split, silu_mul)
    _fp8_gemv_wgmma_kernel[(sh.row_blocks, sh.split)](
        x2, qw, scale, gamma if gamma is not None else scale, bias if bias is not None else scale,
        res2, out2, *ws, m, n, float(row_scale_eps or 0.0), sh.k_per_split,
        x2.stride(0), qw.stride(0), scale.stride(0), res2.stride(0), out2.stride(0),
        K=k, M_PAD=m_pad, BLOCK_N=sh.block_n, BLOCK_K=sh.k_slice, ACC_K=min(128, sh.k_slice), STAGES=stages, SPLIT=sh.split,
        EVEN_K=k % sh.k_per_split == 0, EVEN_N=n % sh.block_n == 0,
        BN_S=block[0] if block else 1, BLOCK_SCALES=block is not None, HAS_GAMMA=gamma is not None,
        HAS_BIAS=bias is not None, HAS_RES=has_res, ROW_SCALE=row_scale_eps is not None, SILU_MUL=silu_mul,
        PRE_K=pre_k, PRE_GROUPS=pre_groups, PRE_UNROLL=pre_unroll,
        num_warps=num_warps, **pdl_launch(x2.device))
