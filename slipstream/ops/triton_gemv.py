"""Small-batch linear layers: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+ residual) for tiny M.

At batch 1 a decode step's GEMMs are matrix-vector products: their time is the weight's
bytes, and on a small model each weight is 2-12 MB, too little for cuBLAS to reach the
copy bandwidth (the 0.6B shape's 112 layer GEMMs took 892 us at batch 1, 3.2x their
bytes' time: benchmarks/notes/benchmarks.md, "Batch 1").  Here each program owns BLOCK_N output
columns and loads their whole K extent (K_PAD, the next power of two) as one tile, before
waiting for the previous kernel (programmatic dependent launch): the weights stream while
that kernel finishes, and the bytes in flight, not the arithmetic, decide the time.  No
split over K, so no partials, counters or second pass: one launch, deterministic for a
given M.

A weight over `stream_weight_bytes` (15 MiB: the 8B shape's 34-117 MB layers, every
lm_head, Qwen3-30B-A3B's 16 MiB o_proj) takes `_gemv_stream_kernel` instead: its columns stream through a pipelined loop
over K in 1,024-wide chunks, which no register tile could hold.  There it beats cuBLAS,
whose one-row kernels split K and add reduce kernels (the 8B shape's layer chain 0.92x
cuBLAS's time; seed-8b-bs1 4.48 -> 3.99 ms a step, 3.86 with `stream_columns`' rule
and 4 stages: benchmarks/notes/kernel-notes.md, "Small-batch GEMV", "Streaming GEMV: columns
and stages").

`residual` adds into the output in fp32 before the one rounding, as cuBLAS's beta = 1
does for `linear_add_`.  Used by `slipstream.ops.linear` on CUDA for M <= `max_rows` (one)
and weights up to `max_weight_bytes` (no bound by default; `GemvConfig`); CUDA-graph safe (launches depend on
shapes only); launched with PDL like the other kernels of a step (`ops/pdl.py`), so at
one row a layer is a chain of PDL kernels with no cuBLAS launch in it.  The reference is
F.linear (`tests/test_gemv.py`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.ops.device import sm_count
from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_fused import silu_mul


@dataclass(frozen=True)
class GemvConfig:
    # M up to this takes the GEMV: at one row it takes 0.52x cuBLAS's time (0.6B shape's layer
    # GEMMs) and 0.45x (135M); from two rows its broadcast product loses (1.1-7x at 2-8 rows
    # on the 0.6B shape; benchmarks/notes/kernel-notes.md, "Small-batch GEMV")
    max_rows: int = 1
    # no bound by default: above stream_weight_bytes the streaming kernel beats cuBLAS too (the
    # 8B shape, lm_head included: seed-8b-bs1 4.48 -> 3.99 ms a step,
    # benchmarks/notes/kernel-notes.md);
    # SLIPSTREAM_GEMV_MAX_MB=16 keeps weights over 16 MiB on cuBLAS (A/B runs)
    max_weight_bytes: int = int(os.environ.get("SLIPSTREAM_GEMV_MAX_MB", str(1 << 20))) << 20
    max_k: int = 16384  # the whole-tile kernel holds BLOCK_N x K_PAD weights in registers
    block_n: int | None = None  # None: from N (`choose_block_n`), within tile_elems
    tile_elems: int = 8192  # M_PAD x BLOCK_N x K_PAD products a program, at most (registers)
    programs_per_sm: int = 4  # choose_block_n aims for at least this many programs an SM
    num_warps: int = 4
    # weights above this many bytes take the streaming kernel (`_gemv_stream_kernel`): a loop
    # over K in stream_block_k chunks instead of the whole K extent in registers.  15 MiB puts
    # 16 MiB weights on it too (Qwen3-30B-A3B's o_proj: its one-row step 3.52 -> 3.41 ms;
    # benchmarks/notes/kernel-notes.md, "Streaming GEMV from 16 MiB")
    stream_weight_bytes: int = int(os.environ.get("SLIPSTREAM_GEMV_STREAM_MB", "15")) << 20
    stream_block_n: int | None = None  # None: `stream_columns`
    stream_wide_bytes: int = 32 << 20  # weights from this size stream 8 or 16 columns a program, else 4
    # a wide weight streams 16 columns while those programs fit on the SMs at once (this many
    # an SM: 16 columns at 4 stages hold ~100 KB of shared memory), else 8 (`stream_columns`)
    stream_wide_programs_per_sm: int = 2
    stream_block_k: int = 1024
    # 4 stages with that choice of columns: seed-8b-bs1 3.95 -> 3.86 ms a step; either alone
    # was slower (3.99, 3.98; benchmarks/notes/kernel-notes.md, "Streaming GEMV: columns and
    # stages")
    stream_stages: int = 4
    stream_warps: int = 4


DEFAULT_GEMV_CONFIG = GemvConfig()


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, M, N, eps,
                 stride_xm, stride_wn, stride_rm, stride_om,
                 K: tl.constexpr, K_PAD: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROW_SCALE: tl.constexpr,
                 SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K_PAD)
    offs_m = tl.arange(0, M_PAD)
    nmask = offs_n < N
    kmask = offs_k < K
    mmask = offs_m < M
    # The program's whole weight tile is loaded *before* waiting for the previous kernel: no
    # kernel writes weights, so their stream overlaps that kernel's tail (the one exception
    # to ops/pdl.py's "wait first"; x, the residual and every store come after the wait).
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                mask=nmask[:, None] & kmask[None, :], other=0.0)
    pdl_start(USE_PDL)
    xmask = mmask[:, None] & kmask[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    x = tl.load(x_ptrs, mask=xmask, other=0.0)
    if SILU_MUL:  # x is [gate | up] (2K wide): the input is silu(gate) * up, rounded once
        x = silu_mul(x, tl.load(x_ptrs + K, mask=xmask, other=0.0)).to(x.dtype)
    acc = tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
    if ROW_SCALE:  # a folded RMSNorm (model/llama.py): times rstd of the input row
        xf = x.to(tl.float32)
        acc = acc * tl.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _stream_input(x_ptr, offs, mask, K: tl.constexpr, SILU_MUL: tl.constexpr):
    """One chunk of the streaming kernel's input row in fp32: x, or silu(gate) * up rounded to
    the input dtype (x is [gate | up], as in `_gemv_kernel`)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SILU_MUL:
        x = silu_mul(x, tl.load(x_ptr + K + offs, mask=mask, other=0.0)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv_stream_kernel(x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, N, eps, stride_wn,
                        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROW_SCALE: tl.constexpr,
                        SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr):
    """One row, a large weight: the program's BLOCK_N columns stream through in BLOCK_K chunks
    (a pipelined loop), products summed elementwise in fp32 and reduced once at the end.  The
    first chunk loads before the PDL wait, as `_gemv_kernel`'s whole tile does."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w0 = tl.load(w_rows, mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_start(USE_PDL)
    xf = _stream_input(x_ptr, offs_k, offs_k < K, K, SILU_MUL)
    acc = w0.to(tl.float32) * xf[None, :]
    sq = xf * xf
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        kmask = (offs_k + k) < K
        w = tl.load(w_rows + k, mask=nmask[:, None] & kmask[None, :], other=0.0)
        xf = _stream_input(x_ptr, offs_k + k, kmask, K, SILU_MUL)
        acc += w.to(tl.float32) * xf[None, :]
        sq += xf * xf
    y = tl.sum(acc, axis=1)
    if ROW_SCALE:
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(r_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


def stream_columns(n: int, weight_bytes: int, sms: int, cfg: GemvConfig = DEFAULT_GEMV_CONFIG) -> int:
    """Output columns a program of the streaming kernel, for a weight of `n` output columns.
    Every program re-reads the input row (twice for silu_mul) from L2, 1 / BLOCK_N of its
    weight bytes, which costs a large weight (the 8B shape) more than the programs it gives
    up; a small one wants the programs. A large weight takes 16 columns while its programs
    all fit on the SMs at once (the 8B shape's o and down: 256 programs), and 8 when 16 would
    leave a partial second wave (qkv's 384, gate_up's, the lm_head's): shorter programs then
    let the SMs that finish first take the rest (and, with PDL, the next kernel's)."""
    if cfg.stream_block_n is not None:
        return cfg.stream_block_n
    if weight_bytes < cfg.stream_wide_bytes:
        return 4
    return 16 if triton.cdiv(n, 16) <= cfg.stream_wide_programs_per_sm * sms else 8


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, cfg: GemvConfig = DEFAULT_GEMV_CONFIG) -> bool:
    """Whether `gemv` takes this product (else cuBLAS): few rows, a small weight."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    wbytes = weight.numel() * weight.element_size()
    # the streaming kernel takes any K (a loop over it); the whole tile at most max_k
    return (0 < rows <= cfg.max_rows and (streams(rows, wbytes, cfg) or weight.shape[1] <= cfg.max_k)
            and weight.stride(1) == 1 and wbytes <= cfg.max_weight_bytes)


def streams(rows: int, weight_bytes: int, cfg: GemvConfig = DEFAULT_GEMV_CONFIG) -> bool:
    """Whether the product takes the streaming kernel rather than the whole tile."""
    return rows == 1 and weight_bytes > cfg.stream_weight_bytes


def choose_block_n(n: int, sms: int, cfg: GemvConfig = DEFAULT_GEMV_CONFIG) -> int:
    """Output columns a program: the largest power of two in [2, 32] that still gives
    `programs_per_sm` programs on every SM (the bytes in flight come from many programs)."""
    if cfg.block_n is not None:
        return cfg.block_n
    block = 32
    while block > 2 and triton.cdiv(n, block) < cfg.programs_per_sm * sms:
        block //= 2
    return block


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
         cfg: GemvConfig = DEFAULT_GEMV_CONFIG, *, row_scale_eps: float | None = None,
         silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) (+ residual [..., N]) into `out` (new if None;
    it may be `residual` itself).

    row_scale_eps: the product is first scaled by each row's rstd(x) = 1 / sqrt(mean(x^2) +
    eps) (a folded RMSNorm's statistic, `scale_rows_ref`; the bias comes after it).
    silu_mul: x is [..., 2K] = [gate | up] and the input is silu(gate) * up (`silu_and_mul_ref`)."""
    k = weight.shape[1]
    lead = x.shape[:-1]
    if x.shape[-1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv: input width {x.shape[-1]} does not match the weight's {k}"
                         f"{' (x2 for silu_mul)' if silu_mul else ''}")
    n = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty((*lead, n), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    res2 = residual.view(-1, n) if residual is not None else out2
    wbytes = weight.numel() * weight.element_size()
    if streams(m, wbytes, cfg):
        block_n = stream_columns(n, wbytes, sm_count(x.device), cfg)
        _gemv_stream_kernel[(triton.cdiv(n, block_n),)](
            x2, weight, bias if bias is not None else weight, res2, out2, n, float(row_scale_eps or 0.0),
            weight.stride(0), K=k, BLOCK_N=block_n, BLOCK_K=cfg.stream_block_k,
            STAGES=cfg.stream_stages, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            ROW_SCALE=row_scale_eps is not None, SILU_MUL=silu_mul, num_warps=cfg.stream_warps,
            **pdl_launch(x.device))
        return out
    m_pad = triton.next_power_of_2(max(m, 1))
    k_pad = triton.next_power_of_2(k)
    fits = _pow2_at_most(max(cfg.tile_elems // (m_pad * k_pad), 1))  # columns whose weights fit in registers
    block_n = min(choose_block_n(n, sm_count(x.device), cfg), fits)
    grid = (triton.cdiv(n, block_n),)
    _gemv_kernel[grid](x2, weight, bias if bias is not None else weight, res2, out2, m, n,
                       float(row_scale_eps or 0.0),
                       x2.stride(0), weight.stride(0), res2.stride(0), out2.stride(0),
                       K=k, K_PAD=k_pad, M_PAD=m_pad, BLOCK_N=block_n,
                       HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                       ROW_SCALE=row_scale_eps is not None, SILU_MUL=silu_mul, num_warps=cfg.num_warps,
                       **pdl_launch(x.device))
    return out


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)
