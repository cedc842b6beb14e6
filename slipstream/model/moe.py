"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral.

The decoder of model/llama.py with each layer's MLP replaced by a sparse MoE block: a router
(one linear to `num_experts` logits; softmax in float32, the top k, renormalised to sum to 1
where the config says so: Mixtral always, Qwen3-MoE with `norm_topk_prob`) and the experts,
SiLU MLPs run together as one fused MoE layer (`ops/moe.py`). Qwen3-MoE keeps Qwen3's
per-head q/k norm. Neither family has shared experts (Qwen2-MoE's) or dense layers between
the sparse ones, and neither is implemented: config.py refuses such configs by name.

A layer's experts are stacked into two parameters, `experts.gate_up_proj` [E, 2I, H] (each
expert's [gate | up] rows) and `experts.down_proj` [E, H, I], the layout transformers 5
keeps in memory; checkpoints hold one tensor per expert and projection, which
`expert_checkpoint_parts` maps into slices of the stacked ones.

Norms: the input norm is folded into the qkv weights as in the dense decoder; the
post-attention norm feeds both the router and the experts, so it runs as its own kernel
(`rms_norm`) and stays unfolded.

Tensor parallelism shards each expert's intermediate dimension, as the dense MLP is
sharded: gate_up column-parallel, down row-parallel (model/shards.py), the router whole on
every rank; each rank's partial output is all-reduced and added into the residual stream.
Expert parallelism (whole experts per rank, tokens exchanged all-to-all) is not implemented.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.model.config import ModelConfig
from slipstream.model.llama import Attention, Linear, LlamaForCausalLM, RMSNorm, empty_parameter, fold_norm
from slipstream.model.parallel import TPGroup
from slipstream.ops.fused import rms_norm
from slipstream.ops.moe import fused_moe, route, route_linear, route_linear_applies

# architecture -> the checkpoint's names: (block, gate, up, down) as in
# model.layers.{i}.{block}.experts.{e}.{gate}.weight and model.layers.{i}.{block}.gate.weight
EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
}


class Experts(nn.Module):
    """E SiLU MLPs stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype, device):
        super().__init__()
        self.gate_up_proj = empty_parameter((num_experts, 2 * inter, hidden), dtype, device)
        self.down_proj = empty_parameter((num_experts, hidden, inter), dtype, device)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device, tp: TPGroup | None = None):
        super().__init__()
        inter = config.moe_intermediate_size if tp is None else tp.shard.moe_intermediate_size
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, False, dtype, device)
        self.experts = Experts(config.num_experts, config.hidden_size, inter, dtype, device)
        self.tp = tp
        # set by LlamaForCausalLM.set_batch_invariant: the experts' result for a token then
        # does not depend on the step's size (`fused_moe`)
        self.batch_invariant = False
        # the fused router's count of its finished programs (`route_linear`): one a layer, so
        # no two launches that may overlap share it
        self.register_buffer("route_counter", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Adds the block's output for x (the normalised h) into the residual stream h."""
        gate = self.gate
        if gate.bias is None and not gate.batch_invariant and route_linear_applies(x, gate.weight, self.top_k):
            # decode sizes: the router's linear and its top-k in one launch
            weights, ids = route_linear(x, gate.weight, self.top_k, self.renormalize, self.route_counter)
        else:
            weights, ids = route(gate(x), self.top_k, self.renormalize)
        experts = self.experts
        if self.tp is None:  # the k outputs summed straight into h
            return fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, residual=h,
                             batch_invariant=self.batch_invariant)
        # each rank's experts hold a slice of the intermediate columns: sum the partial outputs
        out = self.tp.all_reduce(fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids,
                                           batch_invariant=self.batch_invariant))
        return h.add_(out)


class MoEDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device, tp: TPGroup | None = None):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, dtype, device)
        self.self_attn = Attention(config, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, dtype, device)
        self.mlp = SparseMoeBlock(config, dtype, device, tp)

    def forward(self, h, positions, meta, kv_cache, cos_sin_cache):
        """Updates the residual stream h in place."""
        self.self_attn(h, positions, meta, kv_cache, cos_sin_cache)
        return self.mlp(h, rms_norm(h, self.post_attention_layernorm.weight, self.eps))

    def fold_norms(self) -> None:
        """Fold the input norm into the qkv weights (the post-attention norm stays: module doc)."""
        fold_norm(self.input_layernorm, self.self_attn.qkv_proj)


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama-family decoder with sparse MoE layers (Qwen3-MoE, Mixtral)."""
    layer_class = MoEDecoderLayer


def expert_checkpoint_parts(config: ModelConfig, pname: str,
                            rows: int) -> list[tuple[str, int | None, int]] | None:
    """The checkpoint tensors of a MoE block's parameter `pname` (`rows` rows, the stacked
    experts counted as [E * rows, cols]) as (HF name, row offset or None, rows), as the
    loader's `_checkpoint_parts` gives them; None for any other parameter."""
    layer, found, rest = pname.partition(".mlp.")
    if not found:
        return None
    block, gate, up, down = EXPERT_NAMES[config.architecture]
    prefix = f"model.{layer}.{block}"
    experts = config.num_experts
    if rest == "gate.weight":  # the router
        return [(f"{prefix}.gate.weight", None, rows)]
    if rest == "experts.gate_up_proj":
        inter = rows // (2 * experts)
        return [(f"{prefix}.experts.{e}.{name}.weight", (2 * e + j) * inter, inter)
                for e in range(experts) for j, name in enumerate((gate, up))]
    if rest == "experts.down_proj":
        hidden = rows // experts
        return [(f"{prefix}.experts.{e}.{down}.weight", e * hidden, hidden) for e in range(experts)]
    return None
