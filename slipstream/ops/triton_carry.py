"""The Triton kernel of `slipstream.ops.carry` (CUDA; imported only when it runs, so the
CPU engine needs no Triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start


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


@triton.jit(do_not_specialize=["n"])
def _carry_over_shared_kernel(ids_ptr, carry_ptr, tokens0_ptr, tokens1_ptr, slot_ptr, n,
                              BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    src = tl.load(carry_ptr + offs, mask=inside, other=-1)
    take = inside & (src >= 0)
    slot = tl.load(slot_ptr + offs * 0)  # the step's slot: the previous tokens are the other one's
    from0 = tl.load(tokens0_ptr + src, mask=take & (slot != 0), other=0)
    from1 = tl.load(tokens1_ptr + src, mask=take & (slot == 0), other=0)
    tl.store(ids_ptr + offs, tl.where(slot == 0, from1, from0), mask=take)


@triton.jit(do_not_specialize=["n"])
def _tokens_to_slot_kernel(src_ptr, tokens0_ptr, tokens1_ptr, slot_ptr, n,
                           BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    slot = tl.load(slot_ptr + offs * 0)  # (one per lane: masks stay vectors)
    token = tl.load(src_ptr + offs, mask=inside, other=0)
    tl.store(tokens0_ptr + offs, token, mask=inside & (slot == 0))
    tl.store(tokens1_ptr + offs, token, mask=inside & (slot == 1))


def carry_over_shared_triton(input_ids: torch.Tensor, carry_idx: torch.Tensor,
                             slot_tokens: tuple[torch.Tensor, torch.Tensor], slot_index: torch.Tensor) -> None:
    n, block = input_ids.numel(), 1024
    _carry_over_shared_kernel[(triton.cdiv(n, block),)](input_ids, carry_idx, slot_tokens[0], slot_tokens[1],
                                                           slot_index, n, BLOCK=block, **pdl_launch(input_ids.device))


def tokens_to_slot_triton(tokens: torch.Tensor, slot_tokens: tuple[torch.Tensor, torch.Tensor],
                          slot_index: torch.Tensor) -> None:
    n, block = tokens.numel(), 1024
    _tokens_to_slot_kernel[(triton.cdiv(n, block),)](tokens, slot_tokens[0], slot_tokens[1], slot_index, n,
                                                        BLOCK=block, **pdl_launch(tokens.device))
