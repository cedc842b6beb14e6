"""Small-batch linear layers with FP8 weights: y[M, N] = (x * gamma)[M, K] @ (q * scale)[N, K]^T
for M <= 16 rows (the engine takes it up to `Fp8GemvConfig.max_rows`, one row), weight-only:
the input rows stay in their dtype (no activation quantization), the FP8 weight is upcast in
registers.

At small batches a decode step reads every weight once; its time is the weight's bytes, half
of bf16's in FP8. Two kernels stream them (`Fp8GemvConfig` picks one by the number of rows):

- `_fp8_gemv_kernel` (one row; the FP8 sibling of ops/triton_gemv.py's streaming kernel):
  each program owns BLOCK_N output columns and streams their FP8 values through a pipelined
  loop over K (BLOCK_K-wide chunks, the first one loaded before the PDL wait: no kernel
  writes weights), upcasts them to fp32 and multiplies the input row with FMAs. Per weight
  byte it issues ~3.6-4.6 SASS instructions in its loop (the e4m3 -> f16 conversion, one for
  two values, the f16 -> f32 one, the FMA) against the bf16 kernel's 1.85 (two bytes a
  weight), all compiled for sm_90: the issue slots, not the bytes, can bound it.
- `_fp8_gemv_mma_kernel` (ops/triton_fp8_gemv_mma.py; 1-16 rows): the same stream, the
  weight tile converted to f16 and multiplied on tensor cores, so a weight byte costs its
  half conversion and no FMA, and 16 rows cost what one does.

Scales (both kernels): per channel (and per tensor, held per channel) multiply the column's
sum once at the end; with 128 x 128 block scales each block's partial sum is multiplied by
its block's scale (the FMA kernel's chunks hold whole blocks, the MMA kernel's K tile is one
block). Around the product, as in the bf16 GEMV: a folded norm's gamma scales the input's
columns, `row_scale_eps` multiplies by rstd(x) (computed on x itself, before gamma), SiLU·mul
computes the input from [gate | up], then the bias and the residual are added in fp32
before the one rounding. CUDA-graph safe (launches depend on shapes only); PDL like the
other kernels of a step. The reference is `ops.fp8_linear.fp8_linear_ref`
(tests/test_fp8_gemv.py, tests/test_fp8_kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.ops.device import sm_count
from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_fp8_gemv_mma import fp8_gemv_mma
from slipstream.ops.triton_fused import silu_mul
from slipstream.ops.triton_gemv import stream_columns
from slipstream.quant.fp8 import Fp8Weight
from slipstream.utils.overrides import config_from_env


@dataclass(frozen=True)
class Fp8GemvConfig:
    """Which kernel and tiles the FP8 GEMV takes; every field can be overridden from
    benchmarks/bench_fp8_gemv.py --variants (the lead's sweep picks the defaults)."""
    # M up to this takes the GEMV (ops/fp8_linear.py), more rows the FP8 GEMMs; 0: never. One
    # row: at 2-16 rows the skinny GEMM with the input quantized per token reads the 8B
    # shape's weights at 1.18-1.54x their floor against the GEMV's 1.9-4.4x (H100), and a
    # decode step of 8 rows took 4.13 ms against 7.45 (docs/fp8.md, "Small-batch GEMV")
    max_rows: int = 1
    # 1: one row takes the FMA kernel, more rows the MMA kernel; 0: the MMA kernel always (the
    # FMA kernel takes one row only); by its
    # loop's SASS on sm_90 the MMA kernel issues 1.2 instructions a weight byte at one row
    # against the FMA kernel's 3.6-4.6; fma_rows_silu: the same for the down product's
    # SiLU·mul input (None: fma_rows)
    fma_rows: int = 0
    fma_rows_silu: int | None = None
    # the FMA kernel: the bf16 streaming kernel's tuned shape (ops/triton_gemv.py: 1,024-wide
    # chunks, 8 or 16 columns for the 8B shape) in the same bytes: the same chunk width (the
    # fp32 products a thread holds), twice the stages, so as many weight bytes are in flight
    block_n: int | None = None  # None: `stream_columns` of the bf16 kernel
    block_k: int = 1024
    stages: int = 8
    num_warps: int = 4
    # the MMA kernel: rows of the weight a program, the K tile (cut into one slice a warp;
    # block weights: slices of the block's width whatever mma_block_k says), stages, warps,
    # slices of K (split-K; None: `mma_split`, enough programs for every SM)
    mma_block_n: int | None = None  # None: `mma_columns`
    mma_block_k: int | None = None  # None: `mma_tiles`
    mma_stages: int | None = None  # None: `mma_tiles`
    mma_warps: int = 4
    mma_split_k: int | None = None
    # rows are padded to a power of two, at least this (the dot's narrow side is 2 x that:
    # hi and lo; 8 pads every row count to one MMA width in the kernel itself)
    mma_min_m_pad: int = 1

    def mma_tiles(self, rows: int) -> tuple[int, int]:
        """(K tile, stages) of the MMA kernel at `rows` input rows. Defaults: 512-wide K tiles
        at one row, 256 above (the H100 sweep: the 8B layer's four one-row products 107 us
        against 114, its 4-row products faster at 256 or less); stages 3 for 256-wide tiles
        up to 8 rows, else 2 (3 spill registers at 16 rows)."""
        block_k = self.mma_block_k or (512 if rows == 1 else 256)
        return block_k, self.mma_stages or (3 if block_k <= 256 and rows <= 8 else 2)


# the defaults with SLIPSTREAM_FP8_GEMV_CONFIG's "field=value,..." changes (A/B runs in the
# engine, e.g. "mma_block_k=256" or "max_rows=8")
DEFAULT_FP8_GEMV_CONFIG = config_from_env(Fp8GemvConfig, "SLIPSTREAM_FP8_GEMV_CONFIG")


@triton.jit
def _input_chunk(x_ptr, g_ptr, offs, mask, K: tl.constexpr, SILU_MUL: tl.constexpr, HAS_GAMMA: tl.constexpr):
    """(x * gamma, x) of one chunk in fp32; x is silu(gate) * up rounded to the input dtype
    when SILU_MUL (the input is [gate | up])."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SILU_MUL:
        x = silu_mul(x, tl.load(x_ptr + K + offs, mask=mask, other=0.0)).to(x.dtype)
    xf = x.to(tl.float32)
    xg = xf
    if HAS_GAMMA:
        xg = xf * tl.load(g_ptr + offs, mask=mask, other=0.0)
    return xg, xf


@triton.jit
def _chunk_product(w, xg, s_ptr, offs_n, nmask, k, K, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   BN_S: tl.constexpr, BK_S: tl.constexpr, BLOCK_SCALES: tl.constexpr):
    """One chunk's products in fp32: [BLOCK_N, BLOCK_K] per channel (summed at the end); with
    block scales, summed over each BK_S-wide column block first and multiplied by the block's
    scale: [BLOCK_N, BLOCK_K / BK_S] (a small gather, not one scale load a weight)."""
    p = w.to(tl.float32) * xg[None, :]
    if BLOCK_SCALES:
        G: tl.constexpr = BLOCK_K // BK_S
        p = tl.sum(tl.reshape(p, [BLOCK_N, G, BK_S]), axis=2)
        kb = k // BK_S + tl.arange(0, G)
        s = tl.load(s_ptr + (offs_n // BN_S)[:, None] * stride_sn + kb[None, :],
                    mask=nmask[:, None] & (kb < tl.cdiv(K, BK_S))[None, :], other=0.0)
        p = p * s
    return p


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, r_ptr, out_ptr, N, eps, stride_wn, stride_sn,
                     K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     BN_S: tl.constexpr, BK_S: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                     HAS_GAMMA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     ROW_SCALE: tl.constexpr, SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    kmask = offs_k < K
    w0 = tl.load(w_rows, mask=nmask[:, None] & kmask[None, :], other=0.0)
    pdl_start(USE_PDL)
    xg, xf = _input_chunk(x_ptr, g_ptr, offs_k, kmask, K, SILU_MUL, HAS_GAMMA)
    acc = _chunk_product(w0, xg, s_ptr, offs_n, nmask, 0, K, stride_sn, BLOCK_N, BLOCK_K, BN_S, BK_S, BLOCK_SCALES)
    sq = xf * xf
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        kmask = (offs_k + k) < K
        w = tl.load(w_rows + k, mask=nmask[:, None] & kmask[None, :], other=0.0)
        xg, xf = _input_chunk(x_ptr, g_ptr, offs_k + k, kmask, K, SILU_MUL, HAS_GAMMA)
        acc += _chunk_product(w, xg, s_ptr, offs_n, nmask, k, K, stride_sn, BLOCK_N, BLOCK_K, BN_S, BK_S,
                              BLOCK_SCALES)
        sq += xf * xf
    y = tl.sum(acc, axis=1)
    if not BLOCK_SCALES:
        y = y * tl.load(s_ptr + offs_n, mask=nmask, other=0.0)
    if ROW_SCALE:
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(r_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


def fp8_gemv(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
             row_scale_eps: float | None = None, silu_mul: bool = False,
             cfg: Fp8GemvConfig = DEFAULT_FP8_GEMV_CONFIG) -> torch.Tensor:
    """x [..., K] (M rows, at most 16) @ W^T (+ bias) (+ residual [..., N]) into `out` (new if
    None; it may be `residual`). row_scale_eps and silu_mul as in `ops.triton_gemv.gemv`."""
    n, k = w.shape
    width = 2 * k if silu_mul else k
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.shape[-1] != width or not 0 < m <= 16:
        raise ValueError(f"fp8_gemv: 1 to 16 input rows of width {width} expected, got {tuple(x.shape)}")
    x2 = x.reshape(m, width)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    out2 = out.view(m, n)
    res2 = residual.view(m, n) if residual is not None else out2
    fma_rows = cfg.fma_rows if not silu_mul or cfg.fma_rows_silu is None else cfg.fma_rows_silu
    if m > min(fma_rows, 1):
        block_k, stages = cfg.mma_tiles(m)
        fp8_gemv_mma(x2, w, bias, res2, out2, has_res=residual is not None, row_scale_eps=row_scale_eps,
                     silu_mul=silu_mul, block_n=cfg.mma_block_n, block_k=block_k, stages=stages,
                     num_warps=cfg.mma_warps, split=cfg.mma_split_k, sms=sm_count(x.device),
                     min_m_pad=cfg.mma_min_m_pad)
        return out
    qw = w.qweight
    # columns a program as the bf16 kernel picks them for this shape: each program re-reads
    # the bf16 input row, which weighs twice as much against FP8 columns, so not fewer
    block_n = cfg.block_n or stream_columns(n, 2 * qw.numel(), sm_count(x.device))
    block_k = cfg.block_k
    bn_s, bk_s = w.block or (1, 1)
    if w.block is not None and block_k % bk_s:
        block_k = bk_s * max(1, block_k // bk_s)  # chunks of whole scale blocks
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, qw, w.scale, w.gamma if w.gamma is not None else w.scale, bias if bias is not None else w.scale,
        res2, out2, n, float(row_scale_eps or 0.0), qw.stride(0), w.scale.stride(0),
        K=k, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=cfg.stages, BN_S=bn_s, BK_S=bk_s,
        BLOCK_SCALES=w.block is not None, HAS_GAMMA=w.gamma is not None, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, ROW_SCALE=row_scale_eps is not None, SILU_MUL=silu_mul,
        num_warps=cfg.num_warps, **pdl_launch(x.device))
    return out
