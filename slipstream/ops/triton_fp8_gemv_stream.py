"""One-row linear layers with FP8 weights, streamed: y[N] = (x * gamma)[K] @ (q * scale)[N, K]^T,
the candidate for batch-1 decoding (`Fp8GemvConfig.one_row`, SLIPSTREAM_FP8_GEMV=stream).

Why another one-row kernel. At one row a product's time is its weight's bytes, and the 8B
shape's FP8 weights are short streams (o 16.8 MB, qkv 25 MB: 5.6 and 8.4 us at 3 TB/s), so
what costs is each program's chain of round trips, not its instructions. The MMA kernel
(ops/triton_fp8_gemv_mma.py) pays, a program: its first weight tile, the PDL wait, a pass over
the input for each row's range (one trip to L2), and only then the loop's first loads (one
DRAM latency with nothing streaming for that program); split-K's partials, ticket and
reload after the stream; and its 96 KB of shared memory (128-row x 256-column tiles, 3
stages) leave no room on an SM for the next kernel's programs, so their loads before the
wait start only once this kernel's programs leave.

This kernel keeps the MMA kernel's arithmetic (the weight tile converted to f16 exactly and
multiplied on tensor cores against the input in two f16 parts, ops/triton_f16_split.py, a
batched dot with one K slice a warp; 1.2-1.6 SASS instructions a weight byte, against the
FMA kernel's 3.6-4.6, which its CUDA cores could not issue at the copy rate) and changes
the stream around it:

- No range pass: each warp's K slice takes its own power of two from its own values (the
  slice's largest |x * gamma|, which it holds anyway), multiplies its dot by the inverse
  and adds it into the fp32 sum. A slice's largest value is at most the row's, so a value
  keeps what the row-wide scale kept (22 significant bits, nothing below 2^-27 of its
  slice's largest given to f16 subnormals), and a SiLU·mul input takes its exact largest
  value, not a bound. The stream's first loads come right after the wait.
- No split over K: fewer weight rows a program instead (`stream_columns`: 32 for o, qkv and
  down, 128 for gate_up on 132 SMs), so the SMs have programs without a workspace, a
  ticket or a second pass; 32 KB K tiles (widened as the rows narrow: 1,024 columns at 32
  rows, 256 at 128), a program's shared memory 70-82 KB at 3 stages (sm_90, compiled on
  the CPU).
- `prefetch.global.L2` carries the bytes in flight that shared memory does not: before the
  PDL wait a program asks L2 for its `prefetch_tiles` K tiles past the first (which it loads
  into registers there, as the MMA kernel does), and each loop step asks for the tile
  `prefetch_tiles` on, so DRAM keeps streaming while a program waits, converts or
  multiplies. No register or shared memory holds a prefetched line; the loop's loads then
  find it in L2.

The price, counted in SASS (sm_90, this machine's Triton): a slice's own range costs a warp
reduction and a multiply of the dot's result a tile, and fewer rows a program leave less
weight to share the input's work, so the loop issues 2.4-2.7 instructions a weight byte at
32 rows (o, qkv, down) and 1.7-1.8 at 128 (gate_up), against the MMA kernel's 1.1-1.3
(16 rows: ~4, as the FMA kernel). Whether the shorter chain pays for that is the
benchmark's to say (benchmarks/bench_fp8_gemv.py, the `stream` variants).

Scales: per channel (per tensor held per channel) multiply the finished sum; 128 x 128
blocks: a slice is one block's width, its dot multiplied by its block's scale with the
slice's inverse. The epilogues are the other GEMVs': rstd of the input row (`row_scale_eps`,
from x itself, before gamma), SiLU·mul of [gate | up] as the input (rounded to the input's
dtype), the bias and the residual in fp32 before the one rounding. Deterministic: one
program sums a row in a fixed order. The reference is `ops.fp8_linear.fp8_linear_ref`
(tests/test_fp8_gemv_stream.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_f16_split import row_scales, split_f16
from slipstream.ops.triton_fp8_gemm_skinny import _prefetch_l2
from slipstream.ops.triton_fused import silu_mul
from slipstream.quant.fp8 import Fp8Weight

logger = logging.getLogger(__name__)


@triton.jit
def _slice_products(acc, sq, w, x_ptr, g_ptr, s_ptr, offs_n, nmask, kk, k, stride_sn, K: tl.constexpr,
                    K_SLICE: tl.constexpr, WARPS: tl.constexpr, NB: tl.constexpr, BN_S: tl.constexpr,
                    BLOCK_SCALES: tl.constexpr, SILU_MUL: tl.constexpr, HAS_GAMMA: tl.constexpr,
                    ROW_SCALE: tl.constexpr):
    """acc [WARPS, BLOCK_N, NB] and sq [WARPS, K_SLICE] after the K tile at k, whose weights
    w [WARPS, BLOCK_N, K_SLICE] (e4m3) are loaded: each slice's dot against its input in two
    f16 parts at the slice's own power of two, times the inverse (and the block's scale)."""
    kmask = (kk + k) < K
    x = tl.load(x_ptr + kk + k, mask=kmask, other=0.0)
    if SILU_MUL:  # x is [gate | up]: the input is silu(gate) * up, rounded to x's dtype
        x = silu_mul(x, tl.load(x_ptr + K + kk + k, mask=kmask, other=0.0)).to(x.dtype)
    xf = x.to(tl.float32)
    v = xf
    if HAS_GAMMA:
        v = xf * tl.load(g_ptr + kk + k, mask=kmask, other=0.0)
    scale, inverse = row_scales(tl.max(tl.abs(v), axis=1))  # [WARPS]: a power of two a slice
    hi, lo = split_f16(v, scale[:, None])
    col = tl.arange(0, NB)[None, None, :]
    b = tl.where(col == 0, hi[:, :, None], lo[:, :, None])  # hi, lo, then zeros (NB > 2: padding)
    if NB > 2:
        b = tl.where(col < 2, b, tl.zeros_like(b))
    d = tl.dot(w.to(tl.float16), b)  # exact conversion: e4m3 is a subset of f16
    if BLOCK_SCALES:  # a slice is one scale block
        kb = k // K_SLICE + tl.arange(0, WARPS)
        s = tl.load(s_ptr + (offs_n // BN_S)[None, :] * stride_sn + kb[:, None],
                    mask=nmask[None, :] & (kb * K_SLICE < K)[:, None], other=0.0)
        acc += d * (s * inverse[:, None])[:, :, None]
    else:
        acc += d * inverse[:, None, None]
    if ROW_SCALE:
        sq += xf * xf
    return acc, sq


@triton.jit
def _weight_slices(ptrs, nmask, kmask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """[WARPS, BLOCK_N, K_SLICE] e4m3, unmasked where the shapes allow."""
    if EVEN_K and EVEN_N:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=nmask[None, :, None] & kmask[:, None, :], other=0.0)


@triton.jit
def _prefetch_columns(w_ptr, offs_n, nmask, stride_wn, k, K: tl.constexpr, COLS: tl.constexpr):
    """Ask L2 for the program's rows' weight columns k .. k + COLS (one 128-byte line each)."""
    lines = k + tl.arange(0, COLS // 128) * 128
    _prefetch_l2(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + lines[None, :],
                 nmask[:, None] & (lines < K)[None, :], w_ptr)


@triton.jit
def _fp8_gemv_stream_kernel(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, r_ptr, out_ptr, N, eps, stride_wn, stride_sn,
                            K: tl.constexpr, BLOCK_N: tl.constexpr, K_SLICE: tl.constexpr, WARPS: tl.constexpr,
                            STAGES: tl.constexpr, NB: tl.constexpr, PRE_TILES: tl.constexpr,
                            EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                            BN_S: tl.constexpr, BLOCK_SCALES: tl.constexpr, HAS_GAMMA: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROW_SCALE: tl.constexpr,
                            SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr):
    BLOCK_K: tl.constexpr = WARPS * K_SLICE
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    kk = tl.arange(0, WARPS)[:, None] * K_SLICE + tl.arange(0, K_SLICE)[None, :]  # [WARPS, K_SLICE]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :, None] * stride_wn + kk[:, None, :]
    # weights are written by no kernel of a step: the first tile, and the next PRE_TILES
    # tiles into L2, before the wait for the previous kernel
    w0 = _weight_slices(w_ptrs, nmask, kk < K, EVEN_K, EVEN_N)
    if PRE_TILES > 0:
        _prefetch_columns(w_ptr, offs_n, nmask, stride_wn, BLOCK_K, K, PRE_TILES * BLOCK_K)
    pdl_start(USE_PDL)
    acc = tl.zeros([WARPS, BLOCK_N, NB], tl.float32)
    sq = tl.zeros([WARPS, K_SLICE], tl.float32)
    acc, sq = _slice_products(acc, sq, w0, x_ptr, g_ptr, s_ptr, offs_n, nmask, kk, 0, stride_sn, K, K_SLICE,
                              WARPS, NB, BN_S, BLOCK_SCALES, SILU_MUL, HAS_GAMMA, ROW_SCALE)
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        if PRE_TILES > 0:  # the tile PRE_TILES on: the one after those already asked for
            ahead = k + PRE_TILES * BLOCK_K
            if ahead < K:
                _prefetch_columns(w_ptr, offs_n, nmask, stride_wn, ahead, K, BLOCK_K)
        w = _weight_slices(w_ptrs + k, nmask, (kk + k) < K, EVEN_K, EVEN_N)
        acc, sq = _slice_products(acc, sq, w, x_ptr, g_ptr, s_ptr, offs_n, nmask, kk, k, stride_sn, K, K_SLICE,
                                  WARPS, NB, BN_S, BLOCK_SCALES, SILU_MUL, HAS_GAMMA, ROW_SCALE)
    y = tl.sum(tl.sum(acc, axis=2), axis=0)  # [BLOCK_N]: every slice's hi and lo parts
    if not BLOCK_SCALES:
        y = y * tl.load(s_ptr + offs_n, mask=nmask, other=0.0)
    if ROW_SCALE:
        y = y * tl.rsqrt(tl.sum(tl.sum(sq, axis=1), axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(r_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


@dataclass(frozen=True)
class StreamShape:
    """A launch's tiling: weight rows a program, K's slice a warp, programs."""
    block_n: int
    k_slice: int
    programs: int


def stream_columns(n: int, sms: int, programs_per_sm: int = 1, least: int = 32) -> int:
    """Weight rows a program: the most (at most 128, at least `least`: 16 rows cost ~4 SASS
    instructions a weight byte) that give every SM `programs_per_sm` programs (8B shape, 132
    SMs: o, qkv and down 32, gate_up 128). No split over K."""
    block = 128
    while block > least and triton.cdiv(n, block) < programs_per_sm * sms:
        block //= 2
    return block


def stream_shape(n: int, k: int, block_n: int | None, tile_bytes: int, num_warps: int,
                 block: tuple[int, int] | None, sms: int, programs_per_sm: int = 1) -> StreamShape:
    """The tiling `fp8_gemv_stream` launches for an [n, k] weight: K slices of tile_bytes /
    (rows x warps) columns (a power of two in [16, 512]), a scale block's width
    for block weights."""
    block_n = block_n or stream_columns(n, sms, programs_per_sm)
    if block is not None:
        k_slice = block[1]
    else:
        k_slice = max(16, min(512, tile_bytes // (block_n * num_warps), triton.next_power_of_2(k)))
        k_slice = triton.next_power_of_2(k_slice)
    return StreamShape(block_n, k_slice, triton.cdiv(n, block_n))


_NARROW = [2]  # the dot's narrow side: hi and lo, or 16 where this Triton refuses fewer


def fp8_gemv_stream(x1: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, res1: torch.Tensor,
                    out1: torch.Tensor, *, has_res: bool, row_scale_eps: float | None, silu_mul: bool,
                    block_n: int | None, tile_bytes: int, stages: int, num_warps: int, sms: int,
                    programs_per_sm: int = 1, prefetch_tiles: int = 0) -> None:
    """Launch over x1 [K or 2K] (one row, unit stride) into out1 [N]. prefetch_tiles: K
    tiles past the first asked into L2 before the PDL wait, and how far ahead each loop step
    asks for the next (a power of two; 0 none; on CUDA only: inline PTX, which Triton's
    interpreter does not run)."""
    if prefetch_tiles & (prefetch_tiles - 1) or prefetch_tiles < 0:
        raise ValueError(f"fp8_gemv_stream: prefetch_tiles must be 0 or a power of two, not {prefetch_tiles}")
    qw, scale, gamma, blk = w.qweight, w.scale, w.gamma, w.block
    n, k = qw.shape
    sh = stream_shape(n, k, block_n, tile_bytes, num_warps, blk, sms, programs_per_sm)
    tile = num_warps * sh.k_slice
    on_gpu = x1.is_cuda
    args = (x1, qw, scale, gamma if gamma is not None else scale, bias if bias is not None else scale, res1, out1,
            n, float(row_scale_eps or 0.0), qw.stride(0), scale.stride(0))
    consts = dict(K=k, BLOCK_N=sh.block_n, K_SLICE=sh.k_slice, WARPS=num_warps, STAGES=stages,
                  PRE_TILES=prefetch_tiles if on_gpu else 0,
                  EVEN_K=k % tile == 0, EVEN_N=n % sh.block_n == 0, BN_S=blk[0] if blk else 1,
                  BLOCK_SCALES=blk is not None, HAS_GAMMA=gamma is not None, HAS_BIAS=bias is not None,
                  HAS_RES=has_res, ROW_SCALE=row_scale_eps is not None, SILU_MUL=silu_mul,
                  num_warps=num_warps, **pdl_launch(x1.device))
    try:
        _fp8_gemv_stream_kernel[(sh.programs,)](*args, NB=_NARROW[0], **consts)
    except CompilationError:
        if _NARROW[0] >= 16:
            raise
        # a Triton that wants 16 columns a dot: pad hi and lo with zero columns from now on
        # (nothing ran: the launch failed while compiling)
        _NARROW[0] = 16
        logger.warning("fp8_gemv_stream: this Triton refuses dots of 2 columns; they are padded to 16")
        _fp8_gemv_stream_kernel[(sh.programs,)](*args, NB=16, **consts)
