"""Carry-over: the tokens the previous batch just drew replace their placeholders.

`carry_idx[i]` is, for input position i, the row of the previous batch's sampled tokens
that feeds it, or -1.  It runs on the compute stream at the start of a step (inside the
CUDA graph), so only these few tokens wait for the previous batch; one Triton kernel on
CUDA, torch ops elsewhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start


def carry_over_ref(input_ids: torch.Tensor, carry_idx: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    src = prev_tokens[carry_idx.clamp(min=0).long()].to(input_ids.dtype)
    input_ids.copy_(torch.where(carry_idx >= 0, src, input_ids))


@triton.jit(do_not_specialize=["n"])  # n changes every step: no recompiles
def _carry_over_kernel(ids_ptr, carry_ptr, prev_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    src = tl.load(carry_ptr + offs, mask=inside, other=-1)
    take = inside & (src >= 0)
    token = tl.load(prev_ptr + src, mask=take, other=0)
    tl.store(ids_ptr + offs, token, mask=take)


def carry_over_triton(input_ids: torch.Tensor, carry_idx: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    n = input_ids.numel()
    block = 1024
    _carry_over_kernel[(triton.cdiv(n, block),)](input_ids, carry_idx, prev_tokens, n, BLOCK=block,
                                                    **pdl_launch(input_ids.device))


def carry_over(input_ids: torch.Tensor, carry_idx: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """In place: input_ids[i] = prev_tokens[carry_idx[i]] where carry_idx[i] >= 0."""
    if input_ids.is_cuda:
        carry_over_triton(input_ids, carry_idx, prev_tokens)
    else:
        carry_over_ref(input_ids, carry_idx, prev_tokens)
