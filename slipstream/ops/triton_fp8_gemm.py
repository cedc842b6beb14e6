"""FP8 GEMM: y[M, N] = x[M, K] @ (q * scale)[N, K]^T (+ bias), with x quantized per token
(ops/triton_fp8_quant.py) and the products on FP8 tensor cores, accumulated in fp32.

Two scale layouts:
- block weights (scale [N / bn, K / bk]): the input is quantized per token and bk-wide
  column group, the K loop steps BLOCK_K = bk, and each step's partial product is multiplied
  by its input-group scales (rows) and its weight-block scales (columns) before it is added;
- per-channel weights (scale [N]): the input is quantized per token and the two scale
  vectors multiply the finished sum (the batch-invariant path of per-tensor / per-channel
  weights; cuBLASLt serves them otherwise).

Batch invariance: one tile config for every M and no split over K, so every output element
is summed in the same order, and a row's input scales come from that row alone: a row's
result has the same bits in any batch. Launches depend on shapes only (CUDA-graph safe).
The reference is `ops.fp8_linear.fp8_linear_ref(..., quantize_input=True)`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.ops.triton_fp8_quant import SiluMulRows, quantize_rows
from slipstream.quant.fp8 import Fp8Weight


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128  # per-channel weights; block weights step their own bk
    group_m: int = 8  # M-tiles that walk the N-tiles together (the weight stays in L2)
    num_warps: int = 4
    num_stages: int = 3
    # one program an SM walking the tiles (the next tile's loads overlap this one's epilogue);
    # a tile's sums are the same either way, so batch invariance holds
    persistent: bool = False

    @property
    def name(self) -> str:
        """tb-mMnNwWsS[p]: the bench's and the routing table's name of this tile config."""
        return (f"tb-m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                + ("p" if self.persistent else ""))


DEFAULT_FP8_GEMM_CONFIG = Fp8GemmConfig()


def parse_tile_name(name: str) -> Fp8GemmConfig | None:
    """`Fp8GemmConfig.name` back to its config (None: not such a name)."""
    m = re.fullmatch(r"tb-m(\d+)n(\d+)w(\d+)s(\d+)(p?)", name)
    if m is None:
        return None
    bm, bn, w, st = (int(g) for g in m.groups()[:4])
    return Fp8GemmConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, persistent=bool(m.group(5)))


_SMS: dict[int, int] = {}


def _programs(device: torch.device, tiles: int) -> int:
    if device.type != "cuda":
        return min(tiles, 4)  # the interpreter: a few programs, several tiles each
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return min(tiles, _SMS[idx])


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, c_ptr, M, N, K,
                     stride_am, stride_asm, stride_wn, stride_wsn, stride_rm, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, BN_S: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PERSISTENT: tl.constexpr = False):
    if PERSISTENT:
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for pid in tl.range(tl.program_id(0), tiles, tl.num_programs(0)):
            _fp8_gemm_tile(pid, a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, c_ptr, M, N, K,
                           stride_am, stride_asm, stride_wn, stride_wsn, stride_rm, stride_cm,
                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BN_S, BLOCK_SCALES, HAS_BIAS, HAS_RES)
    else:
        _fp8_gemm_tile(tl.program_id(0), a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, c_ptr, M, N, K,
                       stride_am, stride_asm, stride_wn, stride_wsn, stride_rm, stride_cm,
                       BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BN_S, BLOCK_SCALES, HAS_BIAS, HAS_RES)


@triton.jit
def _fp8_gemm_tile(pid, a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, c_ptr, M, N, K,
                   stride_am, stride_asm, stride_wn, stride_wsn, stride_rm, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, BN_S: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % rows
    pid_n = (pid % in_group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kmask = (offs_k + k) < K
        a = tl.load(a_ptrs + k, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs + k, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if BLOCK_SCALES:
            a_s = tl.load(as_ptr + offs_m * stride_asm + k // BLOCK_K, mask=mmask, other=0.0)
            w_s = tl.load(ws_ptr + (offs_n // BN_S) * stride_wsn + k // BLOCK_K, mask=nmask, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            # promoted into the fp32 accumulator every BLOCK_K (as the skinny kernel)
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
    if not BLOCK_SCALES:
        a_s = tl.load(as_ptr + offs_m * stride_asm, mask=mmask, other=0.0)
        w_s = tl.load(ws_ptr + offs_n, mask=nmask, other=0.0)
        acc = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if HAS_RES:  # out += product, rounded once (the residual stream may be `c` itself)
        acc += tl.load(r_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :], mask=omask,
                       other=0.0).to(tl.float32)
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=omask)


def fp8_gemm(x: torch.Tensor | SiluMulRows, w: Fp8Weight, bias: torch.Tensor | None = None,
             cfg: Fp8GemmConfig = DEFAULT_FP8_GEMM_CONFIG, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (times w.gamma) @ W^T (+ bias) (+ residual [M, N]) into `out` (new if None; it
    may be `residual` itself), in x's dtype."""
    n, k = w.shape
    m = x.shape[0]
    block_k = w.block[1] if w.block is not None else cfg.block_k
    q, s = quantize_rows(x, w.gamma, block_k if w.block is not None else None)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    res = residual if residual is not None else out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = (_programs(x.device, tiles) if cfg.persistent else tiles,)
    _fp8_gemm_kernel[grid](
        q, s, w.qweight, w.scale, bias if bias is not None else w.scale, res, out, m, n, k,
        q.stride(0), s.stride(0), w.qweight.stride(0), w.scale.stride(0), res.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        BN_S=w.block[0] if w.block is not None else 1, BLOCK_SCALES=w.block is not None,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, PERSISTENT=cfg.persistent,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
