"""One kernel for everything between the qkv GEMM and attention: the row scale of the
folded input norm and the qkv bias (optional), per-head RMSNorm of q and k (Qwen3,
optional), neox RoPE of q and k, and the store of k and v into the paged KV cache.
Semantics: `slipstream.ops.fused.qkv_epilogue_ref` (the oracle).

An FP8 cache (float8_e4m3fn, `ops/kv_quant.py`) gets k and v times their scale's reciprocal,
saturated to +-448 (the KV_FP8 constexpr: the launches of other caches compile as before).

`qkv_epilogue_triton` writes the rotated q IN PLACE into the q part of `qkv` by default
and returns a strided view [T, Hq, D] of it (or writes into `out=`); k and v go to the
cache only.  The launch depends only on shapes (no host syncs): CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.kv_quant import UNIT_SCALES, KVScales, is_fp8
from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_fused import row_block
from slipstream.ops.triton_qkv_heads import epi_cos_sin, epi_k, epi_q, epi_v

__all__ = ["qkv_epilogue_triton"]


# Grid: (tokens, head blocks).  The head blocks of a token are ceil(Hq / BLOCK_H) q blocks,
# then ceil(Hk / BLOCK_H) k blocks, then as many v blocks; every program handles BLOCK_H
# heads of one kind, so the branch is uniform per program.  The per-head work (loads, norm,
# RoPE, the cache store, and its rounding) is ops/triton_qkv_heads.py's.


@triton.jit
def _qkv_epilogue_kernel(
    qkv_ptr, pos_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, qw_ptr, kw_ptr, q_out_ptr,
    h_ptr, bias_ptr,
    stride_t, stride_cs, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_h,
    n_q_heads, n_kv_heads, eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    Q_NORM: tl.constexpr,
    K_NORM: tl.constexpr,
    Q_MID_FP32: tl.constexpr,
    K_MID_FP32: tl.constexpr,
    N_HIDDEN: tl.constexpr,  # residual-stream width of a folded input norm; 0: none
    HAS_BIAS: tl.constexpr,
    PRE: tl.constexpr,  # N_HIDDEN > 0 or HAS_BIAS
    BLOCK_HID: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr = False,
    # an FP8 cache (KV_FP8): the reciprocals of the layer's k and v scales
    k_inv_scale=None,
    v_inv_scale=None,
    KV_FP8: tl.constexpr = False,
):
    # EARLY (small batches, `prefetch_tokens`): the token's position, rotary row and cache
    # slot are loaded before the PDL wait: no kernel of the step writes them (uploaded before
    # it; the cos/sin table is constant), so their dependent loads overlap the previous
    # kernel's end.  Without it the statements run in their measured order (`if not EARLY`
    # keeps that kernel's compiled code as it was: benchmarks/ptx_diff.py).
    if not EARLY:
        pdl_start(USE_PDL)
    # grid: (tokens, q head blocks + k head blocks + v head blocks); each branch is a
    # helper so that no value escapes an `if` (its types differ between branches)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cos, sin, slot = t, t, t  # placeholders: without EARLY the helpers load these
    if EARLY:
        cos, sin = epi_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        pdl_start(USE_PDL)
    n_qb = tl.cdiv(n_q_heads, BLOCK_H)
    n_kb = tl.cdiv(n_kv_heads, BLOCK_H)
    row = qkv_ptr + t * stride_t
    h_row = h_ptr + t * stride_h
    if hb < n_qb:
        epi_q(row, bias_ptr, h_row, pos_ptr, cs_ptr, qw_ptr, q_out_ptr, t, hb * BLOCK_H,
               n_q_heads, eps, stride_cs, stride_ot, stride_oh, cos, sin,
               HALF, BLOCK_H, Q_NORM, Q_MID_FP32, PRE, HAS_BIAS, N_HIDDEN, BLOCK_HID, EARLY)
    elif hb < n_qb + n_kb:
        epi_k(row, bias_ptr, h_row, pos_ptr, cs_ptr, kw_ptr, slot_ptr, k_cache_ptr, t,
               (hb - n_qb) * BLOCK_H, n_q_heads, n_kv_heads, eps,
               stride_cs, stride_kcb, stride_kcs, stride_kch, cos, sin, slot,
               HALF, BLOCK_H, BLOCK_SIZE, K_NORM, K_MID_FP32, PRE, HAS_BIAS, N_HIDDEN, BLOCK_HID,
               EARLY, k_inv_scale, KV_FP8)
    else:
        epi_v(row, bias_ptr, h_row, slot_ptr, v_cache_ptr, t, (hb - n_qb - n_kb) * BLOCK_H,
               n_q_heads, n_kv_heads, eps, stride_vcb, stride_vcs, stride_vch, slot,
               2 * HALF, BLOCK_H, BLOCK_SIZE, PRE, HAS_BIAS, N_HIDDEN, BLOCK_HID, EARLY,
               v_inv_scale, KV_FP8)


def epilogue_launch(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    batch_invariant: bool = False) -> tuple[int, int]:
    """(heads per program, warps). Blocks of up to 2048 elements, shrunk (down to 1024
    elements) while the grid has fewer than ~1024 programs, so that small decode batches still
    spread over all SMs and prefill gets programs big enough to amortise their fixed cost;
    always 4 warps (1024-element blocks with 4 warps were the fastest at 16-256 rows on the
    0.6B shape: benchmarks/bench_small_kernels.py). batch_invariant: the block of a one-token
    batch at every size, so that no reduction (the row's rstd, the q/k norms) changes its
    order with the batch."""
    bh = max(1, min(triton.next_power_of_2(max(num_heads, num_kv_heads)), 2048 // head_dim))
    tokens = 1 if batch_invariant else num_tokens

    def n_programs(b):
        return tokens * (triton.cdiv(num_heads, b) + 2 * triton.cdiv(num_kv_heads, b))

    while bh > 1 and bh * head_dim > 1024 and n_programs(bh) < 1024:
        bh //= 2
    return bh, 4


def qkv_epilogue_triton(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_heads: int, num_kv_heads: int, head_dim: int,
                        q_norm_weight: torch.Tensor | None = None,
                        k_norm_weight: torch.Tensor | None = None,
                        eps: float = 1e-6, *,
                        hidden: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None,
                        block_h: int | None = None,
                        num_warps: int | None = None,
                        batch_invariant: bool = False,
                        prefetch_tokens: int = 0,
                        kv_scales: KVScales | None = None) -> torch.Tensor:
    """`qkv_epilogue_ref` in one kernel launch; returns q [T, num_heads, head_dim].

    qkv: [T, (Hq + 2 Hk) * D] with a contiguous last dim (any row stride).
    positions / slot_mapping: int32 or int64, at least T entries (the first T are used).
    k_cache / v_cache: [num_blocks, block_size, Hk, D], head_dim contiguous.
    By default q is written IN PLACE into the q columns of qkv and the returned tensor is a
    view of qkv with strides (qkv.stride(0), D, 1); when the result dtype differs from
    qkv's (a float32 norm weight with half inputs) a new tensor is allocated instead.
    `out=` ([T, Hq, D], last dim contiguous) writes q there.
    hidden [T, H] (last dim contiguous): the residual stream the GEMM read, whose norm weight
    is folded into the qkv weights; bias [(Hq + 2 Hk) D]: the qkv bias, added after the
    row scale (`scale_rows_ref`).  `block_h` / `num_warps` override the launch heuristic
    (benchmarks); batch_invariant: a launch shape that does not depend on T
    (`epilogue_launch`).  prefetch_tokens: a batch of at most that many tokens loads its
    positions, rotary rows and cache slots before waiting for the previous kernel (PDL;
    0: never; `ops/fused.py` passes `DecodeConfig.prefetch_batch`, 8 by default).  No host syncs: CUDA-graph
    capturable.  An FP8 cache stores k and v quantized with `kv_scales` (None: 1.0).
    """
    num_tokens = qkv.shape[0]
    D = head_dim
    if D < 2 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two, got {D}")
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * num_kv_heads) * D}], got {tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError("qkv must have a contiguous last dimension")
    if cos_sin_cache.shape[-1] != D:
        raise ValueError(f"cos_sin_cache last dim {cos_sin_cache.shape[-1]} != head_dim {D}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, D):
        raise ValueError(f"caches must be [blocks, block_size, {num_kv_heads}, {D}], "
                         f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k and v caches differ in dtype: {k_cache.dtype} / {v_cache.dtype}")
    block_size = k_cache.shape[1]
    if positions.shape[0] < num_tokens or slot_mapping.shape[0] < num_tokens:
        raise ValueError("positions / slot_mapping shorter than qkv")
    q_norm = q_norm_weight is not None
    k_norm = k_norm_weight is not None
    q_dtype = torch.promote_types(q_norm_weight.dtype, qkv.dtype) if q_norm else qkv.dtype
    q_mid_fp32 = q_dtype == torch.float32
    k_mid_fp32 = k_norm and torch.promote_types(k_norm_weight.dtype, qkv.dtype) == torch.float32
    if out is None:
        if q_dtype == qkv.dtype:
            out = qkv[:, : num_heads * D].view(num_tokens, num_heads, D)
        else:
            out = torch.empty((num_tokens, num_heads, D), dtype=q_dtype, device=qkv.device)
    elif tuple(out.shape) != (num_tokens, num_heads, D) or out.dtype != q_dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {q_dtype} [{num_tokens}, {num_heads}, {D}] with a "
                         f"contiguous last dim, got {out.dtype} {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    for w, name in ((q_norm_weight, "q_norm_weight"), (k_norm_weight, "k_norm_weight")):
        if w is not None and (w.shape != (D,) or w.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{D}] tensor")
    if hidden is not None and (hidden.dim() != 2 or hidden.shape[0] < num_tokens
                               or hidden.stride(-1) != 1):
        raise ValueError(f"hidden must be [{num_tokens}, H] with a contiguous last dim, "
                         f"got {tuple(hidden.shape)}")
    if bias is not None and (bias.shape != (qkv.shape[1],) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{qkv.shape[1]}] tensor")
    n_hidden = hidden.shape[1] if hidden is not None else 0
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    pos = positions if positions.is_contiguous() else positions.contiguous()
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    auto_bh, auto_warps = epilogue_launch(num_tokens, num_heads, num_kv_heads, D, batch_invariant)
    bh = block_h or auto_bh
    num_warps = num_warps or auto_warps
    grid = (num_tokens, triton.cdiv(num_heads, bh) + 2 * triton.cdiv(num_kv_heads, bh))
    _qkv_epilogue_kernel[grid](
        qkv, pos, cs, k_cache, v_cache, slots,
        q_norm_weight if q_norm else qkv, k_norm_weight if k_norm else qkv, out,
        hidden if hidden is not None else qkv, bias if bias is not None else qkv,
        qkv.stride(0), cs.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        hidden.stride(0) if hidden is not None else 0,
        num_heads, num_kv_heads, float(eps),
        HALF=D // 2, BLOCK_H=bh, BLOCK_SIZE=block_size,
        Q_NORM=q_norm, K_NORM=k_norm, Q_MID_FP32=q_mid_fp32, K_MID_FP32=k_mid_fp32,
        N_HIDDEN=n_hidden, HAS_BIAS=bias is not None, PRE=n_hidden > 0 or bias is not None,
        BLOCK_HID=row_block(n_hidden), EARLY=0 < num_tokens <= prefetch_tokens,
        num_warps=num_warps, **pdl_launch(qkv.device),
        # no FMA contraction: the products and sums are rounded like the torch reference's
        enable_fp_fusion=False, **_fp8_args(k_cache, kv_scales),
    )
    return out


def _fp8_args(k_cache: torch.Tensor, kv_scales: KVScales | None) -> dict:
    """The kernel's FP8 arguments; none for another cache, so its launch stays as it was."""
    if not is_fp8(k_cache):
        return {}
    sc = kv_scales or UNIT_SCALES
    return dict(k_inv_scale=sc.inv_k, v_inv_scale=sc.inv_v, KV_FP8=True)
