"""Batch-invariant GEMM: y[M, N] = a[M, K] @ W[N, K]^T where row i of y is bitwise the same
whatever M is and whatever the other rows hold.

cuBLAS picks its kernel (tile shape, split-K) from M, so a row rounds differently in a batch
of another size; that is what makes bf16 sync and async runs drift apart once their batches
differ (docs/architecture.md, "Numerics").  Here the summation order of every output
element depends on (N, K) and the device only:

- One tile config for every M (`GemmConfig`): the same MMA instructions, the same BLOCK_K
  steps over K.
- K is cut into `num_splits` ranges, chosen from (N, K, SM count) only.  Each range is summed
  from zero, BLOCK_K at a time; the range sums are then added in order,
  ((0 + s_0) + s_1) + ...  Large M runs all ranges in one program (`IN_PROGRAM`, no memory
  traffic for partials); small M, where N-tiles alone cannot fill the GPU, runs one range per
  program and `_sum_splits_kernel` adds the fp32 partials in the same order: the same bits.
- Rows beyond M are masked loads (zeros) and never mix with real rows.

Used for every linear layer (and the LM head) when the engine runs with
`batch_invariant=True`.  The reference is `F.linear`; `tests/test_gemm.py` checks both the
values and the bitwise invariance.  Launches depend only on shapes: CUDA-graph safe.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.ops.device import dot_flags, sm_count


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8  # M-tiles that walk the N-tiles together (W stays in L2)
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2  # splits are chosen to give N-tiles x splits >= this x SMs
    min_k_per_split: int = 512


def choose_splits(n: int, k: int, cfg: GemmConfig, sm_count: int) -> tuple[int, int]:
    """(num_splits, k_per_split) from the weight's shape and the device only."""
    tiles_n = triton.cdiv(n, cfg.block_n)
    want = triton.cdiv(cfg.programs_per_sm * sm_count, tiles_n)
    most = max(1, k // max(cfg.min_k_per_split, cfg.block_k))
    splits = max(1, min(want, most))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k
    return triton.cdiv(k, k_per_split), k_per_split


@triton.jit
def _k_range_sum(a_ptr, w_ptr, offs_m, offs_n, M, N, K, k_lo, k_hi, stride_am, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr):
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_kb = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + offs_kb
        a = tl.load(a_rows + offs_k[None, :], mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_hi), other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_hi), other=0.0)
        if UPCAST:  # the interpreter cannot multiply bf16
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    return acc


@triton.jit(do_not_specialize=["M"])  # M changes every step: no recompiles
def _gemm_kernel(a_ptr, w_ptr, y_ptr, part_ptr, M, N, K, k_per_split, num_splits,
                 stride_am, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, IN_PROGRAM: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if IN_PROGRAM:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(0, num_splits):
            k_lo = s * k_per_split
            total += _k_range_sum(a_ptr, w_ptr, offs_m, offs_n, M, N, K, k_lo,
                                  tl.minimum(k_lo + k_per_split, K), stride_am, stride_wn,
                                  BLOCK_M, BLOCK_N, BLOCK_K, IEEE, UPCAST)
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
                 total.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        s = tl.program_id(1)
        k_lo = s * k_per_split
        part = _k_range_sum(a_ptr, w_ptr, offs_m, offs_n, M, N, K, k_lo, tl.minimum(k_lo + k_per_split, K),
                            stride_am, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, UPCAST)
        pp = part_ptr + (s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(pp, part, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(part_ptr, y_ptr, M, N, num_splits, stride_ym, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, num_splits):  # the in-program order: ((0 + s_0) + s_1) + ...
        total += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + offs, total.to(y_ptr.dtype.element_ty), mask=mask)


def invariant_linear(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     cfg: GemmConfig | None = None, *, in_program: bool | None = None) -> torch.Tensor:
    """a [..., K] @ weight[N, K]^T (+ bias) in a's dtype, batch-invariant (see the module doc).

    `in_program` forces the split layout (tests); None picks it from the grid size."""
    cfg = cfg or GemmConfig()
    n, k = weight.shape
    if a.shape[-1] != k:
        raise ValueError(f"invariant_linear: a has {a.shape[-1]} columns, weight has K={k}")
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    assert weight.stride(-1) == 1, "weight needs a contiguous last dimension"
    m = a2.shape[0]
    y = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return y.reshape(*lead, n)
    sms = sm_count(a.device)
    splits, k_per_split = choose_splits(n, k, cfg, sms)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if in_program is None:
        in_program = splits == 1 or tiles >= cfg.programs_per_sm * sms
    part = y if in_program else torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
    ieee, upcast = dot_flags(a.dtype, a.device)
    _gemm_kernel[(tiles, 1 if in_program else splits)](
        a2, weight, y, part, m, n, k, k_per_split, splits, a2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        IN_PROGRAM=in_program, IEEE=ieee, UPCAST=upcast, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if not in_program:
        block = 1024
        _sum_splits_kernel[(m, triton.cdiv(n, block))](part, y, m, n, splits, y.stride(0), BLOCK=block,
                                                       num_warps=4)
    if bias is not None:
        y += bias  # element-wise: invariant
    return y.reshape(*lead, n)


__all__ = ["GemmConfig", "choose_splits", "invariant_linear"]
