"""Mixture-of-experts ops: the router's top-k and the fused MoE layer.

`route` turns router logits into each token's k experts and their weights (on CUDA one Triton
kernel, `slipstream.ops.triton_route`; `route_linear` takes a decode step's router linear into
it too). `fused_moe`
runs the experts: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) over the
k experts e = ids[t, j] of token t. `fused_moe_ref` is the per-expert loop in torch (the CPU
path and the oracle); on CUDA `slipstream.ops.triton_moe` sorts the (token, expert) pairs by
expert on the device and runs two grouped GEMMs over them, and steps of up to
`SMALL_MOE_TOKENS` tokens take `slipstream.ops.triton_moe_small` instead: two GEMV launches
that read each (token, expert) pair's weights straight from the router's ids (no sort, no
padding). In batch-invariant mode every step takes the grouped GEMMs with one fixed tile
(`INVARIANT_TILES`), so a token's result does not depend on its step's size.

Numerics: products accumulate in float32; SiLU·mul is rounded once to x's dtype (the down
product's input); each expert's output is scaled by its float32 weight and rounded to x's
dtype, and the k outputs of a token are summed in float32 (with the residual stream, when
given) and rounded once.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# routers of up to this many rows: the linear inside the top-k kernel (`route_linear`; at most
# triton_route.MAX_LINEAR_ROWS); 0 keeps them apart (A/B runs)
FUSED_ROUTE_ROWS = int(os.environ.get("SLIPSTREAM_FUSED_ROUTE_ROWS", "16"))
# steps of up to this many tokens take the small-batch MoE path (`triton_moe_small`), larger
# ones the grouped GEMMs; 0 never takes it (A/B runs). Past a few tokens the grouped path reads
# each touched expert once where the small one reads it once per token: set from
# `benchmarks/bench_moe.py --small-variants` (both paths at 1, 2, 4 and 8 tokens)
SMALL_MOE_TOKENS = int(os.environ.get("SLIPSTREAM_MOE_SMALL_TOKENS", "4"))
# the grouped GEMMs' tile (block_m, block_n, block_k, num_warps, num_stages) at every step
# size in batch-invariant mode: `moe_config` changes tiles with the step's size, and the sum
# order inside a dot product with them
INVARIANT_TILES = (32, 64, 64, 4, 4)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int32 [T, k]): softmax over the experts in float32,
    the k largest, divided by their sum when `renormalize`. On CUDA one Triton kernel
    (`slipstream.ops.triton_route`: one launch a layer instead of ~5), `route_ref` otherwise."""
    if router_logits.is_cuda:
        from slipstream.ops.triton_route import route_applies, route_triton
        if route_applies(router_logits, top_k):
            return route_triton(router_logits, top_k, renormalize)
    return route_ref(router_logits, top_k, renormalize)


def route_linear_applies(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether `route_linear` takes the router's linear into the top-k kernel: CUDA, up to
    `FUSED_ROUTE_ROWS` rows (`SLIPSTREAM_FUSED_ROUTE_ROWS` in the environment, 16 by default;
    0: never, the linear and then `route`), x's dtype the weight's."""
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] <= FUSED_ROUTE_ROWS):
        return False
    from slipstream.ops.triton_route import route_linear_applies as applies
    return applies(x, weight, top_k)


def route_linear(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                 counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`route(x @ weight^T, top_k, renormalize)` for a bias-free router in one launch
    (`slipstream.ops.triton_route.route_linear_triton`) where `route_linear_applies`; `counter`
    (int32 [1], zero) is the caller's own, one a layer."""
    from slipstream.ops.triton_route import route_linear_triton
    return route_linear_triton(x, weight, top_k, renormalize, counter)


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` in torch ops (the CPU path and the oracle); graph-safe."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w_gate_up [E, 2I, H] ([gate | up] rows), w_down [E, H, I], topk_weights
    float32 [T, k], topk_ids [T, k] -> [T, H] in x's dtype; with `residual` [T, H], the sum
    is added into it in place (one rounding) and it is returned. One expert at a time, over
    the tokens routed to it (host syncs: the CPU path)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if residual is not None:
        out += residual.float()
    ids = topk_ids.long()
    for e in ids.unique().tolist():
        tokens, slots = torch.where(ids == e)
        gate, up = F.linear(x[tokens].float(), w_gate_up[e].float()).chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(x.dtype)
        y = F.linear(act.float(), w_down[e].float()) * topk_weights[tokens, slots, None].float()
        out.index_add_(0, tokens, y.to(x.dtype).float())
    if residual is not None:
        return residual.copy_(out)
    return out.to(x.dtype)


def moe_path(num_tokens: int, batch_invariant: bool = False) -> str:
    """Which CUDA path `fused_moe` takes for a step of `num_tokens` tokens: "small"
    (`triton_moe_small`, up to SMALL_MOE_TOKENS tokens, never in batch-invariant mode: its sums
    run in another order than the grouped GEMMs') or "grouped" (`triton_moe`)."""
    return "small" if 0 < num_tokens <= SMALL_MOE_TOKENS and not batch_invariant else "grouped"


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              residual: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """`fused_moe_ref`'s result: the Triton kernels for CUDA tensors (`moe_path` picks which),
    the reference otherwise. `batch_invariant`: a token's result does not depend on how many
    tokens the step has (the grouped GEMMs with `INVARIANT_TILES` at every size)."""
    if x.is_cuda:
        if moe_path(x.shape[0], batch_invariant) == "small":
            from slipstream.ops.triton_moe_small import fused_moe_small
            return fused_moe_small(x, w_gate_up, w_down, topk_weights, topk_ids, residual=residual)
        from slipstream.ops.triton_moe import MoEConfig, fused_moe_triton
        config = MoEConfig(*INVARIANT_TILES) if batch_invariant else None
        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, config, residual=residual)
    return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, residual)
