"""Linear layers: cuBLAS (`F.linear`) by default; on CUDA the small-batch GEMV
(`slipstream.ops.triton_gemv`) for one row (its streaming kernel for weights over 15 MiB); the batch-invariant
Triton GEMM on request.  `linear_add_` adds a linear's output into a residual stream in
place (cuBLAS beta = 1, or the GEMV's residual input).

At one row the GEMV also takes the work of the small kernels around two of a layer's
products: `norm_linear` applies a folded RMSNorm's row scale (and the bias) inside the qkv
and gate_up products, `silu_mul_linear_add_` computes SiLU·mul while loading the down
product's input. Elsewhere the kernel after the product does it (`ops/fused.py`).

`SLIPSTREAM_GEMV=0` in the environment keeps every product on cuBLAS (A/B runs).

`batch_invariant=True` (the engine's `--batch-invariant`) makes every row's result
independent of the batch it is computed in (`slipstream.ops.triton_gemm`); on the CPU the
torch path runs either way.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


GEMV_ENABLED = os.environ.get("SLIPSTREAM_GEMV", "1") != "0"


def _small_batch(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not (GEMV_ENABLED and x.is_cuda):
        return False
    from slipstream.ops.triton_gemv import gemv_applies
    return gemv_applies(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    if batch_invariant and x.is_cuda:
        from slipstream.ops.triton_gemm import invariant_linear
        return invariant_linear(x, weight, bias)
    if _small_batch(x, weight):
        from slipstream.ops.triton_gemv import gemv
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_add_(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """out += x W^T (+ b), in place; returns out.

    cuBLAS reads `out` as C with beta = 1, so the residual add costs no kernel of its own
    and the sum is rounded once (float32 accumulator + out, then out's dtype)."""
    if batch_invariant and x.is_cuda:
        return out.add_(linear(x, weight, bias, batch_invariant=True))
    if _small_batch(x, weight) and out.is_contiguous():
        from slipstream.ops.triton_gemv import gemv
        return gemv(x, weight, bias, residual=out, out=out)
    out.addmm_(x, weight.t())
    if bias is not None:
        out.add_(bias)
    return out


def linear_into_(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out = x W^T, written into `out` (a tensor-parallel rank's partial product)."""
    if _small_batch(x, weight) and out.is_contiguous():
        from slipstream.ops.triton_gemv import gemv
        return gemv(x, weight, out=out)
    return torch.mm(x, weight.t(), out=out)


def norm_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                batch_invariant: bool = False) -> tuple[torch.Tensor, bool]:
    """h W^T for a W whose RMSNorm weight is folded in (model/llama.py, "Folded norms").
    Returns (y, finished): finished when y already holds rstd(h) * h W^T + b (the GEMV at
    one row); otherwise y = h W^T and the caller's next kernel applies rstd(h) and the bias."""
    if not batch_invariant and _small_batch(h, weight):
        from slipstream.ops.triton_gemv import gemv
        return gemv(h, weight, bias, row_scale_eps=eps), True
    return linear(h, weight, None, batch_invariant), False


def silu_mul_linear_add_(out: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor,
                         hidden: torch.Tensor | None = None, eps: float = 1e-6,
                         batch_invariant: bool = False) -> torch.Tensor:
    """out += silu_and_mul(gate_up, hidden, eps) W^T, in place; returns out. At one row with
    gate_up already finished (hidden None) it is one GEMV that computes SiLU·mul from its
    input; else SiLU·mul's own kernel, then `linear_add_`."""
    if hidden is None and not batch_invariant and _small_batch(gate_up, weight) and out.is_contiguous():
        from slipstream.ops.triton_gemv import gemv
        return gemv(gate_up, weight, residual=out, out=out, silu_mul=True)
    from slipstream.ops.fused import silu_and_mul
    return linear_add_(out, silu_and_mul(gate_up, hidden=hidden, eps=eps), weight, None, batch_invariant)
