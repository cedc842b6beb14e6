"""The Gemma 3 text decoder (`gemma3_text`, Gemma3ForCausalLM).

Where it differs from the Llama decoder (model/llama.py), following transformers:
- RMSNorm scales by (1 + w), in float32 (`GemmaRMSNorm`); the checkpoint stores w, and
  `fold_norms` turns each weight into 1 + w once after loading;
- four norms a layer: before and after attention, before and after the MLP, each
  post-norm applied to its block's output before the residual add; q/k norms per head;
- embeddings scaled by sqrt(hidden_size) (rounded to the model's dtype, as transformers does);
- a GELU-tanh MLP;
- attention scaled by query_pre_attn_scalar ** -0.5;
- two RoPE tables: sliding layers use rope_local_theta unscaled, full layers rope_theta with
  the config's scaling; the sliding layers (five of six: config.layer_types) attend within
  config.sliding_window (ops/attention.py);
- the logits are tanh-softcapped when the config sets final_logit_softcapping.

The norms are not folded into the GEMMs (the post-norms could not be): each is its own few
torch ops. Attention, the q/k norms, RoPE and the KV store are the shared kernels
(`attention_after_qkv`). One rank only: under tensor parallelism the post-attention norm
would need the all-reduced output before the residual add, which RowParallelLinear does
not give.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.model.config import ModelConfig
from slipstream.model.llama import Linear, LlamaForCausalLM, rope_inv_freq
from slipstream.model.parallel import TPGroup
from slipstream.ops.attention import attention_after_qkv
from slipstream.ops.kv_quant import KVScales
from slipstream.ops.fused import build_cos_sin_cache
from slipstream.ops.metadata import AttentionMetadata, QKVEpilogue


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * scale in float32, rounded once to x's dtype (scale = 1 + w)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """`weight`: float32, w as loaded; 1 + w once the model's `fold_norms` ran."""

    def __init__(self, size: int, eps: float, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attention_scale
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, hidden, config.o_bias, dtype, device)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, device)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, device)
        self.window: int | None = None  # set by the model from config.layer_windows
        self.batch_invariant = False
        self.kv_scales: KVScales | None = None  # an FP8 KV cache's scales (model/kv_scales.py)

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache, cos_sin_cache) -> torch.Tensor:
        num_tokens = x.shape[0]
        k_cache, v_cache = kv_cache
        epi = QKVEpilogue(positions, cos_sin_cache, q_norm_weight=self.q_norm.weight,
                          k_norm_weight=self.k_norm.weight, eps=self.eps)
        out = attention_after_qkv(self.qkv_proj(x), epi, k_cache, v_cache, meta, self.scale, self.num_heads,
                                  self.num_kv_heads, self.head_dim, self.batch_invariant, self.window,
                                  self.kv_scales)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device, tp: TPGroup | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, device)
        self.self_attn = Gemma3Attention(config, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, device)
        self.mlp = Gemma3MLP(config, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, device)
        self.local_rope = False  # a sliding layer's RoPE table (set by the model)

    def forward(self, h, positions, meta, kv_cache, cos_sin_cache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), positions, meta, kv_cache, cos_sin_cache)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, tp: TPGroup | None = None):
        if tp is not None:
            raise ValueError("Gemma3ForCausalLM runs on one rank only (tensor_parallel_size=1)")
        super().__init__(config, dtype, device, None)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, self.device)
        types = config.layer_types or ["sliding_attention"] * config.num_layers
        for layer, kind in zip(self.layers, types):
            layer.local_rope = kind == "sliding_attention"
        local = replace(config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling=None)
        self.register_buffer("local_cos_sin_cache",
                             build_cos_sin_cache(rope_inv_freq(local).to(self.device),
                                                 config.max_position_embeddings),
                             persistent=False)
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(dtype).item()

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Every norm weight w becomes 1 + w (once, after loading; the forward pass needs it)."""
        if self.norms_folded:
            raise RuntimeError("the norms are already folded into the weights")
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.add_(1.0)
        self.norms_folded = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), "one (k_cache, v_cache) pair per layer"
        assert self.norms_folded, "load weights with slipstream.model.loader (it folds the norms)"
        h = self.embed_tokens(input_ids) * self.embed_scale
        for layer, kv_cache in zip(self.layers, kv_caches):
            table = self.local_cos_sin_cache if layer.local_rope else self.cos_sin_cache
            h = layer(h, positions, meta, kv_cache, table)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else (torch.tanh(logits.float() / cap) * cap).to(logits.dtype)
