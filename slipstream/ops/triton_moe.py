"""The fused MoE layer in Triton: tokens sorted by expert on the device, then two grouped GEMMs.

A step's N = T * k (token, expert) pairs are "assignments", numbered s = t * k + j.

1. `_align_kernel` (one program) counts the assignments of each expert (a histogram), pads
   each count up to a multiple of BLOCK_M and lays the experts out back to back:
   `sorted_ids` holds, expert after expert, the assignment numbers routed to it (placed by
   an atomic counter per expert, so in no fixed order within the expert), padded with the
   sentinel N; `expert_of_block` names the expert of each BLOCK_M rows; `num_padded` is the
   used length. No host sync: the buffers have the fixed size N + min(E, N) * (BLOCK_M - 1),
   the most that padding can take (only experts with tokens are padded), and the GEMMs'
   grids cover that many blocks, those past `num_padded` returning at once. A row's result
   does not depend on the rows beside it in its block, so neither does the output.
2. `_gate_up_kernel`: for each block, its expert's [gate | up] rows times the block's token
   rows, SiLU(gate) * up in the epilogue -> act [N, I] (row s).
3. `_down_kernel`: act rows times the expert's down weights, scaled by the assignment's
   routing weight -> y [N, H] (row s).
4. `_sum_topk_kernel`: each token's k rows summed in float32 (and added into the residual
   stream, when given), rounded once.

Only the experts that some token routes to have blocks, so only their weights are read: at
one row, the k selected experts'. Launch shapes come from host ints (T, k, E and the
weights' shapes): CUDA-graph safe. Under TRITON_INTERPRET=1 the kernels run on CPU tensors
(tests). The reference is `slipstream.ops.moe.fused_moe_ref`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.ops.device import dot_flags
from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_dot import dot


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # assignment rows per block (each expert's count is padded to a multiple)
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def moe_config(num_assignments: int, num_experts: int) -> MoEConfig:
    """Tiles by the step's size: decode-sized steps (a few rows per expert) use the smallest
    M tile and stream the weights; larger ones a square-ish tile."""
    rows_per_expert = num_assignments / num_experts
    if rows_per_expert <= 16:
        return MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return MoEConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


# the align kernel's assignments per loop step and warps: its loops are latency-bound, so
# wide steps (few of them) are what make it fast
ALIGN_CHUNK = int(os.environ.get("SLIPSTREAM_MOE_ALIGN_CHUNK", "4096"))
ALIGN_WARPS = int(os.environ.get("SLIPSTREAM_MOE_ALIGN_WARPS", "16"))


@dataclass(frozen=True)
class ExpertAlignment:
    sorted_ids: torch.Tensor  # int32 [capacity]: assignment numbers by expert; N = padding;
    # past num_padded: not written
    expert_of_block: torch.Tensor  # int32 [num_blocks]; -1 past num_padded
    num_padded: torch.Tensor  # int32 [1]: the used length of sorted_ids
    num_blocks: int  # host int: blocks of the GEMMs' grids (capacity / block_m)


@triton.jit(do_not_specialize=["N", "NUM_BLOCKS"])
def _align_kernel(ids_ptr, sorted_ptr, expert_of_block_ptr, num_padded_ptr, cursor_ptr, N, NUM_BLOCKS,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, N, CHUNK):  # the assignments of each expert
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < N, other=0)
        counts += tl.histogram(ids, BLOCK_E, mask=offs < N)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    # each expert's padding rows (fewer than BLOCK_M) get the sentinel N; blocks past
    # `total` are never read, so they are left as they are
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + pad, N, mask=pad < ends[:, None])
    # block b belongs to the first expert whose rows end after b * BLOCK_M
    for first in range(0, NUM_BLOCKS, BLOCK_CHUNK):
        blocks = first + tl.arange(0, BLOCK_CHUNK)
        row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(expert_of_block_ptr + blocks, tl.where(row < total, expert, -1), mask=blocks < NUM_BLOCKS)
    # each assignment at its expert's next free row: an atomic counter per expert, so the
    # order within an expert is not fixed, which no row's result depends on
    tl.store(cursor_ptr + experts, starts)
    tl.debug_barrier()  # the counters are written before any thread takes from them
    for start in range(0, N, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < N, other=0)
        dest = tl.atomic_add(cursor_ptr + ids, 1, mask=offs < N)
        tl.store(sorted_ptr + dest, offs, mask=offs < N)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort and pad a step's assignments by expert (`_align_kernel`; the module doc)."""
    n = topk_ids.numel()
    capacity = n + min(num_experts, n) * (block_m - 1)
    num_blocks = triton.cdiv(capacity, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_of_block = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(triton.next_power_of_2(num_experts), dtype=torch.int32, device=dev)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, expert_of_block, num_padded, cursor, n,
                        num_blocks, BLOCK_E=cursor.numel(), BLOCK_M=block_m,
                        CHUNK=min(ALIGN_CHUNK, max(16, triton.next_power_of_2(n))),
                        BLOCK_CHUNK=max(16, 4096 // cursor.numel()), num_warps=ALIGN_WARPS,
                        **pdl_launch(dev))
    return ExpertAlignment(sorted_ids, expert_of_block, num_padded, num_blocks)


@triton.jit
def _block_rows(sorted_ptr, expert_of_block_ptr, num_padded_ptr, N, BLOCK_M: tl.constexpr):
    """(assignment numbers of this program's block, their mask, its expert, whether it is used)."""
    pid_m = tl.program_id(0)
    used = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(expert_of_block_ptr + pid_m)
    return rows, rows < N, expert.to(tl.int64), used


@triton.jit(do_not_specialize=["N"])  # N changes with the step: no recompiles
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, expert_of_block_ptr, num_padded_ptr,
                    N, H, I, stride_x, stride_we, stride_wn, stride_act,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                    USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    rows, valid, expert, used = _block_rows(sorted_ptr, expert_of_block_ptr, num_padded_ptr, N, BLOCK_M)
    if used:
        tokens = (rows // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        w_gate = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        w_up = w_gate + I * stride_wn
        x_rows = x_ptr + tokens[:, None] * stride_x
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, H, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            k_ok = offs_k[None, :] < H
            a = tl.load(x_rows + offs_k[None, :], mask=valid[:, None] & k_ok, other=0.0)
            wg = tl.load(w_gate + offs_k[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
            wu = tl.load(w_up + offs_k[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
            gate += dot(a, tl.trans(wg), None, IEEE, UPCAST)
            up += dot(a, tl.trans(wu), None, IEEE, UPCAST)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["N"])
def _down_kernel(act_ptr, w_ptr, y_ptr, weights_ptr, sorted_ptr, expert_of_block_ptr, num_padded_ptr,
                 N, H, I, stride_act, stride_we, stride_wn, stride_y,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    rows, valid, expert, used = _block_rows(sorted_ptr, expert_of_block_ptr, num_padded_ptr, N, BLOCK_M)
    if used:
        rows64 = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        a_rows = act_ptr + rows64[:, None] * stride_act
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, I, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            k_ok = offs_k[None, :] < I
            a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & k_ok, other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
            acc += dot(a, tl.trans(w), None, IEEE, UPCAST)
        acc *= tl.load(weights_ptr + rows64, mask=valid, other=0.0)[:, None]
        tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["H"])
def _sum_topk_kernel(y_ptr, residual_ptr, out_ptr, H, stride_y, stride_res, stride_out,
                     TOP_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """out[t] = (residual[t] +) sum_j y[t * TOP_K + j], summed in float32, rounded once."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + t * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fused_moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     config: MoEConfig | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe_ref`'s result [T, H] in x's dtype (the module doc); with `residual`, added
    into it in place (one rounding) and returned."""
    num_tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    n = num_tokens * top_k
    cfg = config or moe_config(n, num_experts)
    # tiles no wider than the model's sizes (tl.dot needs 16 at least)
    block_n_up = min(cfg.block_n, max(16, triton.next_power_of_2(inter)))
    block_n_down = min(cfg.block_n, max(16, triton.next_power_of_2(hidden)))
    block_k_up = min(cfg.block_k, max(16, triton.next_power_of_2(hidden)))
    block_k_down = min(cfg.block_k, max(16, triton.next_power_of_2(inter)))
    ieee, upcast = dot_flags(x.dtype, x.device)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device))
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()

    align = align_by_expert(topk_ids, num_experts, cfg.block_m)
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(align.num_blocks, triton.cdiv(inter, block_n_up))](
        x, w_gate_up, act, align.sorted_ids, align.expert_of_block, align.num_padded,
        n, hidden, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=block_n_up, BLOCK_K=block_k_up,
        IEEE=ieee, UPCAST=upcast, **launch)
    y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(align.num_blocks, triton.cdiv(hidden, block_n_down))](
        act, w_down, y, topk_weights.reshape(-1).float(), align.sorted_ids, align.expert_of_block,
        align.num_padded, n, hidden, inter, act.stride(0), w_down.stride(0), w_down.stride(1),
        y.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=block_n_down, BLOCK_K=block_k_down,
        IEEE=ieee, UPCAST=upcast, **launch)
    out = residual if residual is not None else torch.empty_like(x)
    block_h = min(1024, triton.next_power_of_2(hidden))
    res = residual if residual is not None else out
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, res, out, hidden, y.stride(0), res.stride(0), out.stride(0), TOP_K=top_k,
        HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, **pdl_launch(x.device))
    return out
