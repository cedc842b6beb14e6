"""Small-batch linear layers with FP8 weights on tensor cores: y[M, N] = (x * gamma)[M, K] @
(q * scale)[N, K]^T for M <= 16 rows, weight-only (the activations are not quantized).

Why tensor cores for a weight stream: the FMA kernel (ops/triton_fp8_gemv.py) spends per
weight an e4m3 -> f16 conversion (one instruction for two values), an f16 -> f32 conversion
and an FMA: 3.6-4.6 SASS instructions a weight byte in its loop against the bf16 GEMV's 1.85
(two bytes a weight; both compiled for sm_90 on the CPU), so it can run out of issue slots
before it runs out of bandwidth. Here the weight tile is converted to f16 (exactly: e4m3 is
a subset of f16) and an MMA does the multiply-add; the input rows are the MMA's N, the
weight's rows its M ("swap AB"), so more rows cost the MMA nothing.

Layout: each K tile is cut into WARPS slices along K and multiplied as one batched dot
[WARPS, BLOCK_N, K_SLICE] x [WARPS, K_SLICE, 2 M_PAD]: Triton gives each warp its own slice
(mma.sync m16n8k16, the FP8 tile read from shared memory with ldmatrix), so no two warps
convert the same weights, and a program can own 128 weight rows without the wgmma path's
2-byte shared loads of an FP8 operand in registers. The slices' sums are added once at the
end. The input rows are padded to a power of two only (Triton pads the dot's narrow side to
the MMA's 8 itself), so the input's work (loads, SiLU, the f16 split) is the real rows'. The
loop issues 1.2 SASS instructions a weight byte at one input row (128 weight rows a program,
sm_90), 1.5 at 4, 1.9 at 8, 2.9 at 16, against 1.85 for the bf16 GEMV's two-byte weights.

The input in f16 (ops/triton_f16_split.py): after the PDL wait a program reads its columns of
the input rows once for each row's largest |x * gamma| (a bound of it for SiLU·mul), and
multiplies the row by the power of two that brings it into [2^13, 2^14); v is then split
into hi = f16(v') and lo = f16(v' - hi), the B operand's first and second M_PAD columns, and
the slice's sum is (acc_hi + acc_lo) / the power of two. A value keeps 22 significant bits
(a bf16 input's 8 exactly) over bf16's whole range, no part overflows, and nothing of
weight reaches the tensor cores as an f16 subnormal (below 2^-27 of the row's largest):
rows of 1e-12 and spikes of 1e9 are multiplied as accurately as O(1) ones, far inside
e4m3's own 2^-4 (docs/fp8.md, "Small-batch GEMV"). The read costs a pass over the input's
columns (from L2) before the weight stream's loop.

Scales: per channel (per tensor held per channel) multiply the finished sum; 128 x 128
blocks: each slice is one block's width (K_SLICE = 128), its dot starts from zero and is
multiplied by its block's scale before it is added. Split-K (SPLIT > 1, for weights with too
few row blocks to fill the SMs): the program of slice s writes its fp32 partial sum (and its
rows' sum of x^2) to a workspace, and the last program of a row block to arrive (an atomic
ticket) adds the SPLIT partials in a fixed order, so the result does not depend on timing,
and runs the epilogue; it resets the ticket for the next launch (CUDA-graph safe).

The epilogues are the bf16 GEMV's: rstd of each input row (`row_scale_eps`, from x itself,
before gamma), SiLU·mul of [gate | up] as the input, the bias and the residual in fp32 before
the one rounding. The first weight tile loads before the PDL wait (no kernel writes weights);
the workspace and ticket are touched only after it, so a launch never overlaps the previous
one's use of them. The reference is `ops.fp8_linear.fp8_linear_ref`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.tickets import device_key, refuse_in_capture, reserve_tickets, tickets
from slipstream.ops.triton_f16_split import (
    prepass_steps,
    row_amax,
    row_scales,
    split_f16,
)
from slipstream.ops.triton_fused import silu_mul
from slipstream.quant.fp8 import Fp8Weight

logger = logging.getLogger(__name__)


@triton.jit
def _input_tile(x_ptr, g_ptr, offs_m, kk, mmask, kmask, stride_xm, K: tl.constexpr, M_PAD: tl.constexpr,
                SILU_MUL: tl.constexpr, HAS_GAMMA: tl.constexpr, scale):
    """The B operand of one K tile, kk [WARPS, K_SLICE] its columns of K: [WARPS, K_SLICE,
    2 x M_PAD] f16, hi of each row of x * gamma * scale (the row's power of two, [M_PAD]) then
    lo of each (ops/triton_f16_split.py); and x^2 (fp32, [WARPS, K_SLICE, M_PAD]) for the row
    scale. x is silu(gate) * up rounded to the input dtype when SILU_MUL."""
    ptrs = x_ptr + offs_m[None, None, :] * stride_xm + kk[:, :, None]
    mask = kmask[:, :, None] & mmask[None, None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        x = silu_mul(x, tl.load(ptrs + K, mask=mask, other=0.0)).to(x.dtype)
    xf = x.to(tl.float32)
    v = xf
    if HAS_GAMMA:
        v = xf * tl.load(g_ptr + kk, mask=kmask, other=0.0)[:, :, None]
    hi, lo = split_f16(v, scale[None, None, :])
    b = tl.reshape(tl.permute(tl.join(hi, lo), (0, 1, 3, 2)), (hi.shape[0], hi.shape[1], 2 * M_PAD))
    return b, xf * xf


@triton.jit
def _tile(acc, sq, w_ptrs, x_ptr, g_ptr, s_ptr, offs_n, offs_m, kk, k, nmask, mmask, stride_xm, stride_sn,
          w_pre, scale, PRELOADED: tl.constexpr, K: tl.constexpr, K_SLICE: tl.constexpr, M_PAD: tl.constexpr,
          EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BN_S: tl.constexpr,
          BLOCK_SCALES: tl.constexpr, SILU_MUL: tl.constexpr, HAS_GAMMA: tl.constexpr):
    """acc [WARPS, BLOCK_N, 2 M_PAD] and sq after the K tile at k."""
    kmask = (kk + k) < K
    if PRELOADED:
        w = w_pre
    else:
        w = _weight_tile(w_ptrs + k, nmask, kmask, EVEN_K, EVEN_N)
    b, x2 = _input_tile(x_ptr, g_ptr, offs_m, kk + k, mmask, kmask, stride_xm, K, M_PAD, SILU_MUL, HAS_GAMMA,
                        scale)
    w = w.to(tl.float16)  # exact: e4m3 is a subset of f16
    if BLOCK_SCALES:  # a slice is one scale block: its own dot, times the block's scales
        kb = (k // K_SLICE) + tl.arange(0, acc.shape[0])
        s = tl.load(s_ptr + (offs_n // BN_S)[None, :] * stride_sn + kb[:, None],
                    mask=nmask[None, :] & (kb * K_SLICE < K)[:, None], other=0.0)
        acc += tl.dot(w, b) * s[:, :, None]
    else:
        acc = tl.dot(w, b, acc)
    return acc, sq + x2


@triton.jit
def _weight_tile(ptrs, nmask, kmask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """[WARPS, BLOCK_N, K_SLICE] e4m3, unmasked where the shapes allow (no select a byte)."""
    if EVEN_K and EVEN_N:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=nmask[None, :, None] & kmask[:, None, :], other=0.0)


@triton.jit
def _fp8_gemv_mma_kernel(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, r_ptr, out_ptr, ws_ptr, sqws_ptr, ticket_ptr,
                         M, N, eps, k_per_split, stride_xm, stride_wn, stride_sn, stride_rm, stride_om,
                         K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, K_SLICE: tl.constexpr,
                         WARPS: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                         EVEN_N: tl.constexpr, BN_S: tl.constexpr,
                         BLOCK_SCALES: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_RES: tl.constexpr, ROW_SCALE: tl.constexpr, SILU_MUL: tl.constexpr,
                         USE_PDL: tl.constexpr, PRE_K: tl.constexpr = 16, PRE_GROUPS: tl.constexpr = 1,
                         PRE_UNROLL: tl.constexpr = 1):
    BLOCK_K: tl.constexpr = WARPS * K_SLICE
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    kk = tl.arange(0, WARPS)[:, None] * K_SLICE + tl.arange(0, K_SLICE)[None, :]  # [WARPS, K_SLICE]
    nmask = offs_n < N
    mmask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :, None] * stride_wn + kk[:, None, :]
    k0 = split * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    w0 = _weight_tile(w_ptrs + k0, nmask, (kk + k0) < K, EVEN_K, EVEN_N)
    pdl_start(USE_PDL)
    # hi and lo of every row, scaled by a power of two from the row's largest value
    scale, inverse = row_scales(row_amax(x_ptr, g_ptr, offs_m, mmask, k0, k_end, stride_xm, K, PRE_K,
                                         PRE_GROUPS, PRE_UNROLL, SILU_MUL, HAS_GAMMA))
    acc = tl.zeros([WARPS, BLOCK_N, 2 * M_PAD], tl.float32)
    sq = tl.zeros([WARPS, K_SLICE, M_PAD], tl.float32)
    acc, sq = _tile(acc, sq, w_ptrs, x_ptr, g_ptr, s_ptr, offs_n, offs_m, kk, k0, nmask, mmask, stride_xm,
                    stride_sn, w0, scale, True, K, K_SLICE, M_PAD, EVEN_K, EVEN_N, BN_S, BLOCK_SCALES, SILU_MUL,
                    HAS_GAMMA)
    for k in tl.range(k0 + BLOCK_K, k_end, BLOCK_K, num_stages=STAGES):
        acc, sq = _tile(acc, sq, w_ptrs, x_ptr, g_ptr, s_ptr, offs_n, offs_m, kk, k, nmask, mmask, stride_xm,
                        stride_sn, w0, scale, False, K, K_SLICE, M_PAD, EVEN_K, EVEN_N, BN_S, BLOCK_SCALES, SILU_MUL,
                        HAS_GAMMA)
    hi, lo = tl.split(tl.permute(tl.reshape(tl.sum(acc, axis=0), (BLOCK_N, 2, M_PAD)), (0, 2, 1)))
    y = (hi + lo) * inverse[None, :]  # [BLOCK_N, M_PAD]: the slice's sums, unscaled
    sq_m = tl.sum(tl.sum(sq, axis=0), axis=0)  # [M_PAD]
    if SPLIT > 1:
        # this slice's partial sums out; the last program of the row block adds them all
        ws = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws + split * M_PAD * N, y, mask=nmask[:, None])
        # without a row scale sq is dead and its sums of x^2 leave the loop: o and down, split
        # over K, issue ~30% fewer instructions a tile at 8 rows (sm_90, down: 956 -> 661)
        if ROW_SCALE:
            tl.store(sqws_ptr + (pid * SPLIT + split) * M_PAD + offs_m, sq_m)
        tl.debug_barrier()  # every thread's stores before the ticket (its release orders them)
        ticket = tl.atomic_add(ticket_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            y = tl.zeros([BLOCK_N, M_PAD], tl.float32)
            sq_m = tl.zeros([M_PAD], tl.float32)
            for s in tl.static_range(SPLIT):  # in slice order: the same sum whoever comes last
                y += tl.load(ws + s * M_PAD * N, mask=nmask[:, None], other=0.0, cache_modifier=".cg")
                if ROW_SCALE:
                    sq_m += tl.load(sqws_ptr + (pid * SPLIT + s) * M_PAD + offs_m, cache_modifier=".cg")
            _epilogue(y, sq_m, s_ptr, b_ptr, r_ptr, out_ptr, offs_n, offs_m, nmask, mmask, eps, stride_rm,
                      stride_om, K, BLOCK_SCALES, HAS_BIAS, HAS_RES, ROW_SCALE)
            tl.atomic_xchg(ticket_ptr + pid, 0, sem="relaxed", scope="gpu")  # for the next launch
    else:
        _epilogue(y, sq_m, s_ptr, b_ptr, r_ptr, out_ptr, offs_n, offs_m, nmask, mmask, eps, stride_rm,
                  stride_om, K, BLOCK_SCALES, HAS_BIAS, HAS_RES, ROW_SCALE)


@triton.jit
def _epilogue(y, sq_m, s_ptr, b_ptr, r_ptr, out_ptr, offs_n, offs_m, nmask, mmask, eps, stride_rm, stride_om,
              K: tl.constexpr, BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
              ROW_SCALE: tl.constexpr):
    """Scale, row scale, bias, residual, the one rounding: y [BLOCK_N, M_PAD] fp32."""
    if not BLOCK_SCALES:
        y = y * tl.load(s_ptr + offs_n, mask=nmask, other=0.0)[:, None]
    if ROW_SCALE:
        y = y * tl.rsqrt(sq_m / K + eps)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    omask = nmask[:, None] & mmask[None, :]
    if HAS_RES:
        y += tl.load(r_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y.to(out_ptr.dtype.element_ty), mask=omask)


def mma_columns(n: int) -> int:
    """Weight rows a program (the MMA's M): 128 (the input's work is a fixed cost a K tile, so
    as many weight bytes as the registers allow: the loop's SASS instructions a weight byte on
    sm_90, one input row 1.2 at 128 rows against 2.9 at 64 with 8 padded rows; 16 rows 2.9
    against 4.5), fewer for a weight of fewer rows. Split-K (`mma_split`) fills the SMs."""
    block = 128
    while block > 16 and block >= 2 * n:
        block //= 2
    return block


def mma_split(row_blocks: int, k_tiles: int, sms: int) -> int:
    """Slices of K: the smallest power of two (at most 8, and at most the K tiles) that gives
    every SM a program (the 8B shape's o and down at 64 rows a program: 64 row blocks, 4
    slices)."""
    split = 1
    while row_blocks * split < sms and split < min(8, k_tiles):
        split *= 2
    return split


@dataclass
class _Workspace:
    """Split-K's device memory: fp32 partials and the partial sums of x^2 a row (the tickets
    are ops/tickets.py's). One a device, shared by every product: they run one after another
    on the compute stream, and with PDL a launch touches it only after its wait, when the
    previous kernel has finished."""
    partials: torch.Tensor
    squares: torch.Tensor


_WORKSPACES: dict[torch.device, _Workspace] = {}


def reserve_mma_workspace(device: torch.device, n: int) -> None:
    """Allocate (the tickets zeroed, eagerly) what a product of `n` output rows can need at any
    row count and split (at most 8 slices, 16-row blocks): the model calls it at load, so that
    no workspace is first allocated inside a CUDA graph capture, where the tickets' zeros
    would not be written until the graph's first replay."""
    device = device_key(device)
    _grow(device, 8 * 16 * n, triton.cdiv(n, 16) * 8 * 16)
    reserve_tickets(device, triton.cdiv(n, 16))


def _grow(device: torch.device, partials: int, squares: int) -> _Workspace:
    device = device_key(device)
    ws = _WORKSPACES.get(device)
    if ws is not None and ws.partials.numel() >= partials and ws.squares.numel() >= squares:
        return ws
    refuse_in_capture(device, "fp8_gemv: its split-K workspace", "reserve_mma_workspace")
    old = ws or _Workspace(*(torch.empty(0, device=device) for _ in range(2)))
    ws = _Workspace(torch.empty(max(partials, old.partials.numel()), dtype=torch.float32, device=device),
                    torch.empty(max(squares, old.squares.numel()), dtype=torch.float32, device=device))
    _WORKSPACES[device] = ws
    return ws


def _workspace(device: torch.device, n: int, row_blocks: int, split: int, m_pad: int):
    """(partials [split, m_pad, n], squares [row_blocks, split, m_pad], tickets [row_blocks])."""
    ws = _grow(device, split * m_pad * n, row_blocks * split * m_pad)
    return (ws.partials[:split * m_pad * n].view(split, m_pad, n),
            ws.squares[:row_blocks * split * m_pad].view(row_blocks, split, m_pad),
            tickets(device, row_blocks)[:row_blocks])


def fp8_gemv_mma(x2: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, res2: torch.Tensor,
                 out2: torch.Tensor, *, has_res: bool, row_scale_eps: float | None, silu_mul: bool,
                 block_n: int | None, block_k: int, stages: int, num_warps: int, split: int | None,
                 sms: int, min_m_pad: int = 1) -> None:
    """Launch over x2 [M, K or 2K] (M <= 16, unit stride along K) into out2 [M, N]. block_n:
    None: `mma_columns`; block_k: the K tile (num_warps slices); block weights take slices of
    their block's width. split: slices of K (None: `mma_split`). The rows are padded to a power
    of two, at least min_m_pad (Triton pads a narrow dot's side to the MMA's 8 itself: the
    input's work, loads, SiLU and splits, is then the real rows' only)."""
    m_pad = max(triton.next_power_of_2(x2.shape[0]), min_m_pad, _NARROW_FLOOR[0])
    try:
        _launch(x2, w, bias, res2, out2, m_pad, has_res, row_scale_eps, silu_mul, block_n, block_k, stages,
                num_warps, split, sms)
    except CompilationError:
        if m_pad >= 8:
            raise
        # a Triton that wants 16 columns a dot: pad the rows to 8 (hi and lo: 16) from now on
        # (nothing ran: the launch failed while compiling)
        _NARROW_FLOOR[0] = 8
        logger.warning("fp8_gemv: this Triton refuses dots of %d columns; rows are padded to 8", 2 * m_pad)
        _launch(x2, w, bias, res2, out2, 8, has_res, row_scale_eps, silu_mul, block_n, block_k, stages,
                num_warps, split, sms)


_NARROW_FLOOR = [1]  # the least row padding this Triton compiles (8 once a narrower dot failed)


@dataclass(frozen=True)
class MmaShape:
    """A launch's tiling: weight rows a program, K's slice a warp, row blocks, slices of K."""
    block_n: int
    k_slice: int
    row_blocks: int
    split: int
    k_per_split: int


def mma_shape(n: int, k: int, block_n: int | None, block_k: int, num_warps: int, block: tuple[int, int] | None,
              split: int | None, sms: int) -> MmaShape:
    """The tiling `fp8_gemv_mma` launches for an [n, k] weight (`block`: its scale blocks, if any)."""
    block_n = block_n or mma_columns(n)
    k_slice = block[1] if block is not None else max(16, block_k // num_warps)
    tile = num_warps * k_slice
    row_blocks = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, tile)
    split = split or mma_split(row_blocks, k_tiles, sms)
    split = max(1, min(split, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * tile
    return MmaShape(block_n, k_slice, row_blocks, triton.cdiv(k, k_per_split), k_per_split)  # no empty slice


def _launch(x2, w, bias, res2, out2, m_pad, has_res, row_scale_eps, silu_mul, block_n, block_k, stages,
            num_warps, split, sms) -> None:
    qw, scale, gamma, block = w.qweight, w.scale, w.gamma, w.block
    m = x2.shape[0]
    n, k = qw.shape
    sh = mma_shape(n, k, block_n, block_k, num_warps, block, split, sms)
    tile = num_warps * sh.k_slice
    ws = _workspace(x2.device, n, sh.row_blocks, sh.split, m_pad) if sh.split > 1 else (out2, out2, out2)
    pdl = pdl_launch(x2.device)
    pre_k, pre_groups, pre_unroll = prepass_steps(m_pad, sh.k_per_split, silu_mul)
    _fp8_gemv_mma_kernel[(sh.row_blocks, sh.split)](
        x2, qw, scale, gamma if gamma is not None else scale, bias if bias is not None else scale,
        res2, out2, *ws, m, n, float(row_scale_eps or 0.0), sh.k_per_split,
        x2.stride(0), qw.stride(0), scale.stride(0), res2.stride(0), out2.stride(0),
        K=k, M_PAD=m_pad, BLOCK_N=sh.block_n, K_SLICE=sh.k_slice, WARPS=num_warps, STAGES=stages, SPLIT=sh.split,
        EVEN_K=k % sh.k_per_split == 0 and sh.k_per_split % tile == 0, EVEN_N=n % sh.block_n == 0,
        BN_S=block[0] if block else 1, BLOCK_SCALES=block is not None, HAS_GAMMA=gamma is not None,
        HAS_BIAS=bias is not None, HAS_RES=has_res, ROW_SCALE=row_scale_eps is not None, SILU_MUL=silu_mul,
        PRE_K=pre_k, PRE_GROUPS=pre_groups, PRE_UNROLL=pre_unroll,
        num_warps=num_warps, **pdl)
