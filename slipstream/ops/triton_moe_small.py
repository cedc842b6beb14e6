"""The fused MoE layer for a few tokens (decode at batch 1-4): two GEMV launches, no sort.

At one token the layer's floor is the k routed experts' weights (Qwen3-30B-A3B: 8 x 3 x 768 x
2048 x 2 B = 75 MB, ~25 us on an H100). The grouped path (`triton_moe.py`) pays fixed costs on
top that a few tokens cannot hide: the align kernel (a sort by expert), padding every expert's
rows to a 16-row tile, and four launches. Here the router's ids are read directly:

1. `_small_gate_up_kernel`, a program per (assignment s = t * k + j, BLOCK_N intermediate
   columns): the expert ids[s]'s gate and up rows times x[t], streamed over H in BLOCK_K chunks
   (products summed elementwise in float32, reduced once at the end), SiLU(gate) * up rounded
   to x's dtype -> act [T k, I]. T k I / BLOCK_N programs (384 at one Qwen3-30B-A3B token with
   BLOCK_N 16) keep every SM streaming weights.
2. `_small_down_kernel`, a program per (token t, BLOCK_N hidden columns): for j = 0 .. k-1 in
   that order, the expert ids[t, j]'s down rows times act[t k + j], scaled by the routing weight
   and rounded to x's dtype (as the grouped path's y rows are), summed in float32 after the
   residual (when given), rounded once. The k slots are reduced inside one program in a fixed
   order: no atomics, no zeroed buffer, no third launch, and the result is deterministic; a
   token's output does not depend on the other tokens of the step. The slots and their
   BLOCK_K chunks are one flat loop, so its pipeline streams the next slot's expert while the
   current one's last chunk is summed. The token's k ids and routing weights are read once,
   before the loop; they, the residual row and the first slot's first weight tile are read
   before the PDL wait (no kernel after the router writes them), so only act, gate_up's output,
   waits for gate_up.

The numerics are those of the grouped path and of `fused_moe_ref` (module doc of `ops/moe.py`)
up to the order of float32 sums inside a dot product; the two paths do not agree bit for bit,
so batch-invariant mode keeps every batch size on the grouped path (`ops/moe.py`, `fused_moe`).

An expert picked by several of the step's tokens has its weights read once per token (the
second read mostly from L2): the path is for a handful of tokens, up to `ops.moe`'s
`SMALL_MOE_TOKENS`, past which the grouped GEMMs read each expert once.

Graph-safe: no host sync; grids and buffers depend on T, k and the weights' shapes only.
Launched with PDL (`ops/pdl.py`); the expert ids come from the router kernel before gate_up, so
gate_up's weight loads wait for it, and down's do not. Under TRITON_INTERPRET=1 the kernels run
on CPU tensors (tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_fused import silu_mul
from slipstream.utils.overrides import config_from_env


@dataclass(frozen=True)
class SmallMoEConfig:
    """Tiles of the two kernels (each clipped to the model's sizes); `benchmarks/bench_moe.py
    --small-variants` times others."""
    up_block_n: int = 16  # intermediate columns a gate_up program (x2: gate and up rows)
    up_block_k: int = 128  # hidden columns a loop step
    down_block_n: int = 8  # hidden columns a down program
    down_block_k: int = 256  # intermediate columns a loop step
    num_warps: int = 4
    num_stages: int = 4  # the loops' software pipeline depth: 3 chunks in flight while one is summed

    def __post_init__(self):
        for name in ("up_block_n", "up_block_k", "down_block_n", "down_block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"SmallMoEConfig.{name} must be a power of two, got {v}")
        if self.num_stages < 1:
            raise ValueError(f"SmallMoEConfig.num_stages must be at least 1, got {self.num_stages}")


# the default tiles with SLIPSTREAM_MOE_SMALL_CONFIG's "field=value,..." changes (A/B runs)
DEFAULT_SMALL_CONFIG = config_from_env(SmallMoEConfig, "SLIPSTREAM_MOE_SMALL_CONFIG")


@triton.jit
def _small_gate_up_kernel(x_ptr, ids_ptr, w_ptr, act_ptr, stride_x, stride_we, stride_wn, stride_act,
                          H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # the ids are the router's output
    s = tl.program_id(0).to(tl.int64)
    t = s // TOP_K
    expert = tl.load(ids_ptr + s).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w_up = w_gate + I * stride_wn  # the up rows follow the gate rows
    x_row = x_ptr + t * stride_x + offs_k
    gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k_ok = (offs_k + k) < H
        m = col_ok[:, None] & k_ok[None, :]
        xf = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        gate += tl.load(w_gate + k, mask=m, other=0.0).to(tl.float32) * xf
        up += tl.load(w_up + k, mask=m, other=0.0).to(tl.float32) * xf
    act = silu_mul(tl.sum(gate, axis=1), tl.sum(up, axis=1))
    tl.store(act_ptr + s * stride_act + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _slot_of(row_ids, row_weights, offs_j, j):
    """Slot j's expert id and routing weight, picked from the token's k of each in registers."""
    expert = tl.sum(tl.where(offs_j == j, row_ids, 0), axis=0)
    weight = tl.sum(tl.where(offs_j == j, row_weights, 0.0), axis=0)
    return expert, weight


@triton.jit
def _down_step(slot, total, w, act_ptr, s, c, weight, offs_k, k_ok, stride_act, BLOCK_K: tl.constexpr,
               CHUNKS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """One (slot, chunk) step of the down kernel: the weight tile w [BLOCK_N, BLOCK_K] times
    act's chunk, added into the slot's sum; on the slot's last chunk that sum, scaled by its
    routing weight and rounded as a y row of the grouped path, is added into the total."""
    a = tl.load(act_ptr + s * stride_act + c * BLOCK_K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    slot += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    done = c == CHUNKS - 1
    y = (slot * weight).to(OUT_DTYPE).to(tl.float32)
    total += tl.where(done, y, 0.0)
    slot = tl.where(done, 0.0, slot)
    return slot, total


@triton.jit
def _small_down_kernel(act_ptr, ids_ptr, weights_ptr, w_ptr, res_ptr, out_ptr,
                       stride_act, stride_we, stride_wn, stride_res, stride_out,
                       H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
                       STAGES: tl.constexpr, TOP_K_P2: tl.constexpr, USE_PDL: tl.constexpr):
    # everything but act, gate_up's output, is loaded before the PDL wait (ops/pdl.py's
    # exception): the ids and routing weights (the router's, the kernel before gate_up), the
    # residual (the o projection's) and the first slot's first weight tile (no kernel's)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    offs_k = tl.arange(0, BLOCK_K)
    w_cols = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    total = tl.zeros([BLOCK_N], tl.float32)
    if HAS_RESIDUAL:
        total += tl.load(res_ptr + t * stride_res + cols, mask=col_ok, other=0.0).to(tl.float32)
    # the token's k ids and routing weights read once, before the loop: in it a slot's expert
    # is a register select, so no weight load waits on an id load
    offs_j = tl.arange(0, TOP_K_P2)
    row_ids = tl.load(ids_ptr + t * TOP_K + offs_j, mask=offs_j < TOP_K, other=0).to(tl.int64)
    row_weights = tl.load(weights_ptr + t * TOP_K + offs_j, mask=offs_j < TOP_K, other=0.0)
    # the flat loop's first step (slot 0, chunk 0), its weight tile loaded before the wait
    k_ok = offs_k < I
    expert, weight = _slot_of(row_ids, row_weights, offs_j, 0)
    w = tl.load(w_cols + expert * stride_we, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    pdl_start(USE_PDL)
    slot = tl.zeros([BLOCK_N], tl.float32)
    slot, total = _down_step(slot, total, w, act_ptr, t * TOP_K, 0, weight, offs_k, k_ok, stride_act,
                             BLOCK_K, CHUNKS, out_ptr.dtype.element_ty)
    # the rest: one flat loop over (slot j, chunk c of CHUNKS = cdiv(I, BLOCK_K)) in a fixed
    # order (deterministic sums), with no branch in it, so the pipeline keeps loads in flight
    # across the slots' boundaries
    for i in tl.range(1, TOP_K * CHUNKS, num_stages=STAGES):
        j = i // CHUNKS
        c = i % CHUNKS
        k_ok = (offs_k + c * BLOCK_K) < I
        expert, weight = _slot_of(row_ids, row_weights, offs_j, j)
        w = tl.load(w_cols + expert * stride_we + c * BLOCK_K, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        slot, total = _down_step(slot, total, w, act_ptr, t * TOP_K + j, c, weight, offs_k, k_ok, stride_act,
                                 BLOCK_K, CHUNKS, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def _tile(block: int, size: int) -> int:
    """A tile no wider than the next power of two of the size it covers."""
    return min(block, triton.next_power_of_2(size))


def fused_moe_small(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    config: SmallMoEConfig | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe_ref`'s result [T, H] in x's dtype in two launches (the module doc); with
    `residual`, added into it in place (one rounding) and returned."""
    cfg = config or DEFAULT_SMALL_CONFIG
    num_tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    if w_down.shape != (num_experts, hidden, inter) or w_gate_up.shape[2] != hidden:
        raise ValueError(f"fused_moe_small: x {tuple(x.shape)}, gate_up {tuple(w_gate_up.shape)}, "
                         f"down {tuple(w_down.shape)} do not agree")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"fused_moe_small: weights {tuple(topk_weights.shape)}, ids "
                         f"{tuple(topk_ids.shape)} for {num_tokens} tokens")
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    ids = topk_ids.contiguous().reshape(-1)
    weights = topk_weights.float().contiguous().reshape(-1)
    out = residual if residual is not None else torch.empty_like(x)
    if num_tokens == 0:
        return out
    launch = dict(num_warps=cfg.num_warps, **pdl_launch(x.device))
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    block_n_up = _tile(cfg.up_block_n, inter)
    _small_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, block_n_up))](
        x, ids, w_gate_up, act, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        H=hidden, I=inter, TOP_K=top_k, BLOCK_N=block_n_up, BLOCK_K=_tile(cfg.up_block_k, hidden),
        STAGES=cfg.num_stages, **launch)
    block_n_down, block_k_down = _tile(cfg.down_block_n, hidden), _tile(cfg.down_block_k, inter)
    res = residual if residual is not None else out
    _small_down_kernel[(num_tokens, triton.cdiv(hidden, block_n_down))](
        act, ids, weights, w_down, res, out, act.stride(0), w_down.stride(0), w_down.stride(1),
        res.stride(0), out.stride(0), H=hidden, I=inter, TOP_K=top_k, HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n_down, BLOCK_K=block_k_down, CHUNKS=triton.cdiv(inter, block_k_down),
        STAGES=cfg.num_stages, TOP_K_P2=triton.next_power_of_2(top_k), **launch)
    return out
