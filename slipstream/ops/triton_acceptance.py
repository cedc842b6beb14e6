"""A verification step's point-mass acceptance in one Triton kernel (CUDA; imported only when
it runs).  The rule and its torch reference: runner/acceptance.py (`emit_point_mass`).

A program per drafting row r: the first position j < num_drafts whose draft differs from the
sampler's draw there is the accepted count (num_drafts when none does); under the bench's
synthetic acceptance the count is min(A, drafted) instead, plus one where the row's hash pick
falls below the fraction's bound (the sampler's hash, ops/triton_sampling.py).  The row emits
its accepted drafts, then the draw at the accepted count, then -1, into row rows[r] of the
step's outputs, with the counts and the slot token (the last emitted one).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_sampling import mix32, row_keys


@triton.jit
def _point_mass_kernel(drawn_ptr, drafts_ptr, drafts_stride, num_drafts_ptr, num_drafts_stride, rows_ptr,
                       seed_ptr, tidx_ptr, tokens_ptr, tokens_stride, num_emitted_ptr, drafted_ptr,
                       slot_tokens_ptr, threshold,
                       K: tl.constexpr, KP: tl.constexpr, SYNTHETIC: tl.constexpr, WHOLE: tl.constexpr,
                       FRACTION: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    j = tl.arange(0, KP)
    drawn = tl.load(drawn_ptr + r * (K + 1) + j, mask=j <= K, other=0)
    drafts = tl.load(drafts_ptr + r * drafts_stride + j, mask=j < K, other=0)
    nd = tl.load(num_drafts_ptr + r * num_drafts_stride).to(tl.int32)
    match = (drawn == drafts) & (j < nd)
    accepted = tl.min(tl.where(match, KP, j), axis=0)  # the first mismatch (nd at most)
    if SYNTHETIC:
        accepted = tl.minimum(nd, WHOLE)
        if FRACTION:
            k1, k2 = row_keys(seed_ptr, tidx_ptr, row)
            h = mix32(mix32(k1 ^ 0xFFFFFFFE) ^ k2)  # the lane runner/acceptance.SYNTHETIC_LANE
            extra = ((h >> 8).to(tl.int32) < threshold).to(tl.int32)
            accepted = tl.minimum(nd, accepted + extra)
    token = tl.sum(tl.where(j == accepted, drawn, 0), axis=0)
    out = tl.where(j < accepted, drafts, tl.where(j == accepted, drawn, -1))
    tl.store(tokens_ptr + row * tokens_stride + j, out, mask=j <= K)
    tl.store(num_emitted_ptr + row, accepted + 1)
    tl.store(drafted_ptr + row, nd)
    tl.store(slot_tokens_ptr + row, token)


def emit_point_mass_triton(drawn: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                           rows: torch.Tensor, seed: torch.Tensor, token_index: torch.Tensor,
                           synthetic: tuple[int, int] | None, tokens: torch.Tensor, num_emitted: torch.Tensor,
                           drafted: torch.Tensor, slot_tokens: torch.Tensor) -> None:
    """runner/acceptance.emit_point_mass on the GPU; `synthetic` is (floor(A), the fraction's
    24-bit bound) or None.  `drawn` int32 [R, k + 1] contiguous; `drafts` [R, k] and
    `num_drafts` [R] with unit column stride (the static verify inputs' columns)."""
    R, K1 = drawn.shape
    if R == 0:
        return
    assert drawn.is_contiguous() and drafts.stride(1) == 1 and tokens.stride(1) == 1
    for t in (num_emitted, drafted, slot_tokens):
        assert t.is_contiguous() and t.dtype == torch.int32
    whole, threshold = synthetic if synthetic is not None else (0, 0)
    _point_mass_kernel[(R,)](drawn, drafts, drafts.stride(0), num_drafts, num_drafts.stride(0), rows,
                             seed, token_index, tokens, tokens.stride(0), num_emitted, drafted, slot_tokens,
                             threshold, K=K1 - 1, KP=triton.next_power_of_2(K1), SYNTHETIC=synthetic is not None,
                             WHOLE=whole, FRACTION=threshold > 0, **pdl_launch(drawn.device))
