"""Carry-over: the tokens the previous batch just drew replace their placeholders.

`carry_idx[i]` is, for input position i, the row of the previous batch's sampled tokens
that feeds it, or -1.  It runs on the compute stream at the start of a step (inside the
CUDA graph), so only these few tokens wait for the previous batch; one Triton kernel on
CUDA (`slipstream.ops.triton_carry`, imported when first used: the CPU path needs no
Triton), torch ops elsewhere.

A CUDA graph shared by the two IO slots (runner/graphs.py) reads one set of inputs whoever
runs it, so it learns the step's slot from the inputs (`slot_index`, a device scalar):
`carry_over_shared` takes the previous tokens from the other slot, and `tokens_to_slot`
copies the step's sampled tokens into its own slot, where they are downloaded and the next
step carries them over.
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


def carry_over_shared_ref(input_ids: torch.Tensor, carry_idx: torch.Tensor,
                          slot_tokens: tuple[torch.Tensor, torch.Tensor], slot_index: torch.Tensor) -> None:
    carry_over_ref(input_ids, carry_idx, torch.where(slot_index == 0, slot_tokens[1], slot_tokens[0]))


def carry_over_shared(input_ids: torch.Tensor, carry_idx: torch.Tensor,
                      slot_tokens: tuple[torch.Tensor, torch.Tensor], slot_index: torch.Tensor) -> None:
    """carry_over from the tokens of the slot other than slot_index[0] (slot_tokens: both
    slots' token buffers, in slot order)."""
    if input_ids.is_cuda:
        from slipstream.ops.triton_carry import carry_over_shared_triton
        carry_over_shared_triton(input_ids, carry_idx, slot_tokens, slot_index)
    else:
        carry_over_shared_ref(input_ids, carry_idx, slot_tokens, slot_index)


def tokens_to_slot_ref(tokens: torch.Tensor, slot_tokens: tuple[torch.Tensor, torch.Tensor],
                       slot_index: torch.Tensor) -> None:
    n = tokens.numel()
    for i, dst in enumerate(slot_tokens):
        dst[:n].copy_(torch.where(slot_index == i, tokens, dst[:n]))


def tokens_to_slot(tokens: torch.Tensor, slot_tokens: tuple[torch.Tensor, torch.Tensor],
                   slot_index: torch.Tensor) -> None:
    """slot_tokens[slot_index[0]][:len(tokens)] = tokens, the slot chosen on the device."""
    if tokens.is_cuda:
        from slipstream.ops.triton_carry import tokens_to_slot_triton
        tokens_to_slot_triton(tokens, slot_tokens, slot_index)
    else:
        tokens_to_slot_ref(tokens, slot_tokens, slot_index)
