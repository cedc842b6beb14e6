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
