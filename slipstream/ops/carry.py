"""Carry-over: the tokens the previous batch just drew replace their placeholders.

`carry_idx[i]` is, for input position i, the row of the previous batch's sampled tokens
that feeds it, or -1.  It runs on the compute stream at the start of a step (inside the
CUDA graph), so only these few tokens wait for the previous batch; one Triton kernel on
CUDA (`slipstream.ops.triton_carry`, imported when first used: the CPU path needs no
Triton), torch ops elsewhere.
"""
from __future__ import annotations

import torch


def carry_over_ref(input_ids: torch.Tensor, carry_idx: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    src = prev_tokens[carry_idx.clamp(min=0).long()].to(input_ids.dtype)
    input_ids.copy_(torch.where(carry_idx >= 0, src, input_ids))


def carry_over_triton(input_ids: torch.Tensor, carry_idx: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    from slipstream.ops.triton_carry import carry_over_triton as kernel
    kernel(input_ids, carry_idx, prev_tokens)


def carry_over(input_ids: torch.Tensor, carry_idx: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """In place: input_ids[i] = prev_tokens[carry_idx[i]] where carry_idx[i] >= 0."""
    if input_ids.is_cuda:
        carry_over_triton(input_ids, carry_idx, prev_tokens)
    else:
        carry_over_ref(input_ids, carry_idx, prev_tokens)
