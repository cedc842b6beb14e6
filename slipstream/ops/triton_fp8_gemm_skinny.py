"""FP8 GEMM for few rows (2-256; one row takes the GEMV): y[M, N] = x[M, K] @ (q * scale)[N, K]^T
(+ bias) (+ residual), x quantized per token (ops/triton_fp8_quant.py), products on FP8 tensor cores
in fp32.

Why a kernel of its own: at a few dozen rows the product reads the weight once and is bound
by its bytes, and a tile of 64+ activation rows (the GEMM's, cuBLASLt's) wastes most of each
MMA on padding rows. Here the operands are swapped: a program computes y^T's tile
[BLOCK_N weight rows, BLOCK_M activation rows] = W_tile @ x_tile^T, so the weight fills the
MMA's 64-row side and the activation rows its narrow side (Hopper's wgmma m64nXk32, X = 8 to
256). FP8 MMAs want both operands K-major, which W [N, K] and x [M, K] already are.

`split_k` > 1 splits K over programs too (N = 4096 at BLOCK_N 64 gives 64 programs for 132
SMs; `skinny_config_for`): each split writes its fp32 partial to a workspace and counts itself in done by one
atomic; the split that arrives last sums the partials in split order (the same bits whatever
the arrival order), runs the epilogue and puts its tile's counter back to zero: the counters
(ops/tickets.py, reserved at model load) need no memset kernel before a launch, which would
break the step's PDL chain, and launches stay shape-only and CUDA-graph safe.

Scales: per-channel weights (scale [N]) multiply the finished sum with the row scales;
block weights (scale [N / bn, K / bk]) step K by bk, and each step's product is scaled by
its input-group and weight-block scales before it is added. The reference is
`ops.fp8_linear.fp8_linear_ref(..., quantize_input=True)`. Not batch-invariant (the tile
shape and split follow the rows): `batch_invariant=True` takes ops/triton_fp8_gemm.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.tickets import reserve_tickets, tickets
from slipstream.ops.triton_fp8_quant import SiluMulRows, quantize_rows
from slipstream.quant.fp8 import Fp8Weight


@dataclass(frozen=True)
class Fp8SkinnyConfig:
    block_n: int = 64  # weight rows a program: the MMA's M side (wgmma's 64)
    block_m: int = 32  # activation rows a program: the MMA's N side (8-256; a power of two >= 16)
    block_k: int = 128  # per-channel weights; block weights step their own bk
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 5  # weight bytes in flight: the product is bound by them
    # with PDL, the first prefetch_k columns of each of the program's weight rows are asked
    # into L2 before the wait for the input's quantization (weights are written by no kernel
    # of a step): the weight stream starts while the quantization runs. 0: off.
    prefetch_k: int = 1024


DEFAULT_FP8_SKINNY_CONFIG = Fp8SkinnyConfig()


SMS = 132  # an H100 SXM's (an H200's too): the programs a split aims at


def reserve_skinny_tickets(device: torch.device) -> None:
    """The counters any launch of `skinny_config_for`'s tiles can need (it splits K only where
    the tiles are fewer than SMS), zeroed before any graph capture."""
    reserve_tickets(device, SMS)


def skinny_config_for(m: int, n: int, k: int) -> Fp8SkinnyConfig:
    """The tile for `m` rows: the narrowest activation tile that holds them (16-64); K split
    (up to 4 ways, at least 512 columns a split) when the tiles alone leave SMs idle; stages
    as `_stages_for` the grid."""
    base = DEFAULT_FP8_SKINNY_CONFIG
    block_m = min(max(16, triton.next_power_of_2(m)), 64)
    tiles = triton.cdiv(n, base.block_n) * triton.cdiv(m, block_m)
    split = max(1, min(4, triton.cdiv(SMS, tiles), k // 512))
    stage_bytes = (base.block_n + block_m) * base.block_k  # one FP8 weight tile and input tile
    return Fp8SkinnyConfig(block_m=block_m, split_k=split, num_stages=_stages_for(tiles * split, stage_bytes))


SMEM_PER_SM = 228 * 1024  # an H100's (an H200's too); each resident program reserves 1 KB more


def _stages_for(programs: int, stage_bytes: int) -> int:
    """The default's stages, or one fewer where that alone lets every program be resident at
    once: a grid a little larger than one wave runs its remainder as a second wave. On an H100,
    gate_up at 17-32 rows (448 programs; 3 an SM at 5 stages, 4 at 4) took 50.4 / 50.9 us at 4
    stages against 54.8 / 55.3 at 5; at 48-64 rows 4 stages still leave a second wave and lost
    (58.6 against 52.8 us), and 5 stays (benchmarks/bench_fp8_skinny.py)."""
    stages = DEFAULT_FP8_SKINNY_CONFIG.num_stages

    def resident(s: int) -> int:
        return SMS * (SMEM_PER_SM // (s * stage_bytes + 1024))

    if resident(stages) < programs <= resident(stages - 1):
        return stages - 1
    return stages


@triton.jit
def _fp8_skinny_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K,
                       stride_am, stride_asm, stride_wn, stride_wsn, stride_rm, stride_cm,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, BN_S: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
                       PREFETCH_K: tl.constexpr = 0):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    mmask = offs_m < M
    # this split's K range, whole BLOCK_K steps (block scales index by step)
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    k_lo = pid_s * per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + per_split * BLOCK_K)
    if PREFETCH_K > 0:  # one L2 prefetch a 128-byte line, before the wait (pdl.py's exception)
        lines = k_lo + tl.arange(0, PREFETCH_K // 128) * 128
        addr = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + lines[None, :]
        _prefetch_l2(addr, nmask[:, None] & (lines < k_hi)[None, :], w_ptr)
    pdl_start(USE_PDL)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    a_ptrs = a_ptr + offs_m.to(tl.int64)[None, :] * stride_am + offs_k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        kmask = (offs_k + k) < K
        w = tl.load(w_ptrs + k, mask=nmask[:, None] & kmask[None, :], other=0.0)
        a = tl.load(a_ptrs + k, mask=kmask[:, None] & mmask[None, :], other=0.0)
        if BLOCK_SCALES:
            w_s = tl.load(ws_ptr + (offs_n // BN_S) * stride_wsn + k // BLOCK_K, mask=nmask, other=0.0)
            a_s = tl.load(as_ptr + offs_m * stride_asm + k // BLOCK_K, mask=mmask, other=0.0)
            acc += tl.dot(w, a) * w_s[:, None] * a_s[None, :]
        else:
            # the fp8 dot's sum moves into the fp32 accumulator every BLOCK_K: Triton's default
            # on sm_90 keeps all of K in the tensor cores' accumulator (~14 mantissa bits),
            # which at K = 14336 put outputs 2-3x past the reference's rounding bound
            acc = tl.dot(w, a, acc, max_num_imprecise_acc=BLOCK_K)
    if not BLOCK_SCALES:
        w_s = tl.load(ws_ptr + offs_n, mask=nmask, other=0.0)
        a_s = tl.load(as_ptr + offs_m * stride_asm, mask=mmask, other=0.0)
        acc = acc * w_s[:, None] * a_s[None, :]
    omask = nmask[:, None] & mmask[None, :]
    if SPLIT_K > 1:
        # partial [split, M, N] in fp32; the last split of this tile to arrive finishes it
        tile = pid_m * tl.num_programs(0) + pid_n
        part = part_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(part + pid_s.to(tl.int64) * M * N, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial stored before the (releasing) count
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, SPLIT_K):
                acc += tl.load(part + s * M * N, mask=omask, other=0.0, cache_modifier=".cg")
            _epilogue(acc, offs_n, offs_m, omask, nmask, b_ptr, r_ptr, c_ptr, stride_rm, stride_cm,
                      HAS_BIAS, HAS_RES)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # for the next launch
    else:
        _epilogue(acc, offs_n, offs_m, omask, nmask, b_ptr, r_ptr, c_ptr, stride_rm, stride_cm,
                  HAS_BIAS, HAS_RES)


@triton.jit
def _prefetch_l2(ptrs, mask, base):
    """`prefetch.global.L2` of each masked-in address (no value comes back); masked-out lanes
    prefetch `base` (a valid address) instead."""
    safe = tl.where(mask, ptrs, base)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [safe],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _epilogue(acc, offs_n, offs_m, omask, nmask, b_ptr, r_ptr, c_ptr, stride_rm, stride_cm,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (+ bias) (+ residual) stored transposed into c [M, N]."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    rows = offs_m.to(tl.int64)[None, :]
    if HAS_RES:  # out += product, rounded once (the residual stream may be `c` itself)
        acc += tl.load(r_ptr + rows * stride_rm + offs_n[:, None], mask=omask, other=0.0).to(tl.float32)
    tl.store(c_ptr + rows * stride_cm + offs_n[:, None], acc.to(c_ptr.dtype.element_ty), mask=omask)


def fp8_gemm_skinny(x: torch.Tensor | SiluMulRows, w: Fp8Weight, bias: torch.Tensor | None = None,
                    cfg: Fp8SkinnyConfig | None = None, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (times w.gamma) @ W^T (+ bias) (+ residual [M, N]) into `out` (new if None; it
    may be `residual` itself), in x's dtype. `cfg` None: `skinny_config_for` the shape."""
    n, k = w.shape
    m = x.shape[0]
    cfg = cfg or skinny_config_for(m, n, k)
    assert cfg.prefetch_k == 0 or (cfg.prefetch_k >= 128 and cfg.prefetch_k & (cfg.prefetch_k - 1) == 0), cfg
    block_k = w.block[1] if w.block is not None else cfg.block_k
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    if cfg.split_k > 1:  # the counters: ops/tickets.py's, left at zero by every launch
        part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        cnt = tickets(x.device, grid[0] * grid[1])
    else:
        part = cnt = out  # unused
    q, s = quantize_rows(x, w.gamma, block_k if w.block is not None else None)
    res = residual if residual is not None else out
    pdl = pdl_launch(x.device)
    _fp8_skinny_kernel[grid](
        q, s, w.qweight, w.scale, bias if bias is not None else w.scale, res, out, part, cnt, m, n, k,
        q.stride(0), s.stride(0), w.qweight.stride(0), w.scale.stride(0), res.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=block_k, SPLIT_K=cfg.split_k,
        BN_S=w.block[0] if w.block is not None else 1, BLOCK_SCALES=w.block is not None,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, PREFETCH_K=cfg.prefetch_k if pdl["USE_PDL"] else 0, **pdl)
    return out
