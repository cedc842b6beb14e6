"""Linear layers: cuBLAS (`F.linear`) by default, the batch-invariant Triton GEMM on request.

`batch_invariant=True` (the engine's `--batch-invariant`) makes every row's result
independent of the batch it is computed in (`slipstream.ops.triton_gemm`); on the CPU the
torch path runs either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    if batch_invariant and x.is_cuda:
        from slipstream.ops.triton_gemm import invariant_linear
        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)
