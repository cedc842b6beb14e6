"""Linear layers with FP8 weights (docs/fp8.md): the interface of model/llama.py's `Linear`
and `RowParallelLinear`, over the FP8 ops of ops/fp8_linear.py.

Parameters: `weight` float8_e4m3fn [N, K] and `weight_scale` float32 ([N], or [N / bn, K / bk]
for block scales: quant/fp8.py's layout), filled by the loader (model/fp8_loading.py).
A folded RMSNorm weight (`fold_input_scale`) is kept as `gamma` [K] and scales the input's
columns inside the product: multiplying it into FP8 weights would round them twice.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.model.parallel import TPGroup
from slipstream.ops.fp8_linear import (fp8_linear, fp8_linear_add_, fp8_linear_into_, fp8_norm_linear,
                                       fp8_silu_mul_linear_add_)
from slipstream.ops.fused import silu_and_mul
from slipstream.quant.fp8 import FP8_DTYPE, Fp8Weight
from slipstream.quant.scheme import Fp8Scheme


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in FP8 and its scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, scheme: Fp8Scheme):
        super().__init__()
        self.scheme = scheme
        self.weight = nn.Parameter(torch.empty((out_features, in_features), dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.ones(scheme.scale_shape(out_features, in_features), dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias = (nn.Parameter(torch.empty((out_features,), dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.register_buffer("gamma", None, persistent=False)
        self.batch_invariant = False  # set by LlamaForCausalLM.set_batch_invariant
        self.fp8 = Fp8Weight(self.weight, self.weight_scale, scheme.block)
        if self.weight.is_cuda:  # the GEMV's and skinny GEMM's split-K memory, before any graph capture
            from slipstream.ops.triton_fp8_gemm_skinny import reserve_skinny_tickets
            from slipstream.ops.triton_fp8_gemv_mma import reserve_mma_workspace
            reserve_mma_workspace(self.weight.device, out_features)
            reserve_skinny_tickets(self.weight.device)

    @torch.no_grad()
    def fold_input_scale(self, gamma: torch.Tensor) -> None:
        """Scale the input's columns by `gamma` (a folded RMSNorm's weight) in every product."""
        self.gamma = gamma.detach().float().clone()
        self.fp8 = Fp8Weight(self.weight, self.weight_scale, self.scheme.block, self.gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8, self.bias, self.batch_invariant)

    def norm_forward(self, h: torch.Tensor, eps: float) -> tuple[torch.Tensor, bool]:
        """`ops.linear.norm_linear`'s (y, finished) for this layer."""
        return fp8_norm_linear(h, self.fp8, self.bias, eps, self.batch_invariant)

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear_add_(out, x, self.fp8, self.bias, self.batch_invariant)

    def add_silu_mul_into(self, out: torch.Tensor, gate_up: torch.Tensor, hidden: torch.Tensor | None,
                          eps: float) -> torch.Tensor:
        return fp8_silu_mul_linear_add_(out, gate_up, self.fp8, hidden, eps, self.batch_invariant)


class Fp8RowParallelLinear(Fp8Linear):
    """`RowParallelLinear` with FP8 weights: each rank's partial product, summed by one all-reduce
    (rank 0 adds the residual and the bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, scheme: Fp8Scheme,
                 tp: TPGroup):
        super().__init__(in_features, out_features, bias, dtype, device, scheme)
        self.tp = tp

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.tp.rank == 0:
            fp8_linear_add_(out, x, self.fp8, self.bias, self.batch_invariant)
        else:
            fp8_linear_into_(out, x, self.fp8, self.batch_invariant)
        return self.tp.all_reduce(out)

    def add_silu_mul_into(self, out: torch.Tensor, gate_up: torch.Tensor, hidden: torch.Tensor | None,
                          eps: float) -> torch.Tensor:
        return self.add_into(out, silu_and_mul(gate_up, hidden=hidden, eps=eps))
