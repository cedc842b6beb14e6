"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Plain PyTorch over a flat batch of tokens: `input_ids [T]` holds the new tokens of every
sequence of the batch back to back, `meta` says where each sequence starts and how long its
context is, and each layer writes its new K/V into the paged cache before attending over it.
q/k/v and gate/up are merged into one weight each, so each is a single matmul.

The forward pass is CUDA-graph capturable: no host syncs, no branching on tensor values, no
data-dependent shapes, no state kept between calls other than the caches passed in.
Parameter names mirror Hugging Face's without the leading "model." (see loader.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.model.config import ModelConfig
from slipstream.ops.attention import AttentionMetadata, paged_attention
from slipstream.ops.fused import (build_cos_sin_cache, fused_add_rms_norm, qkv_epilogue, rms_norm,
                                  silu_and_mul)
from slipstream.ops.linear import linear


def _empty(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); weights are filled by the loader, so they are not initialised here."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = _empty((out_features, in_features), dtype, device)
        self.bias = _empty((out_features,), dtype, device) if bias else None
        self.batch_invariant = False  # set by LlamaForCausalLM.set_batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.batch_invariant)


class Embedding(nn.Module):
    def __init__(self, num: int, size: int, dtype, device):
        super().__init__()
        self.weight = _empty((num, size), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim / 2]: the rotary frequencies, with the config's scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the
        # band between the two thresholds interpolated linearly in (context / wavelength).
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        ramp = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        # ramp = 1 where wavelen <= old_len / high (kept), 0 where wavelen >= old_len / low
        inv_freq = (1 - ramp) * inv_freq / factor + ramp * inv_freq
    elif kind == "freq_factors":  # GGUF: per-frequency divisors stored in `rope_freqs.weight`
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    return inv_freq.float()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, hidden, config.o_bias, dtype, device)
        self.qk_norm = config.qk_norm
        self.batch_invariant = False
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, dtype, device)

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache, cos_sin_cache):
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        # q/k norm (Qwen3) + RoPE + KV-cache store: one kernel on CUDA (q is then a view
        # into qkv), the torch reference on CPU
        q = qkv_epilogue(qkv, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                         self.num_heads, self.num_kv_heads, self.head_dim,
                         q_norm_weight=self.q_norm.weight if self.qk_norm else None,
                         k_norm_weight=self.k_norm.weight if self.qk_norm else None,
                         eps=self.eps)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, batch_invariant=self.batch_invariant)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(hidden, 2 * inter, False, dtype, device)
        self.down_proj = Linear(inter, hidden, False, dtype, device)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, dtype, device)
        self.self_attn = Attention(config, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(self, x, residual, positions, meta, kv_cache, cos_sin_cache):
        # `x` is the previous block's output, `residual` the running sum before it
        # (None at the first layer); the residual add is fused into the norm.
        if residual is None:
            residual = x
            x = rms_norm(x, self.input_layernorm.weight, self.eps)
        else:
            x, residual = fused_add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        x = self.self_attn(x, positions, meta, kv_cache, cos_sin_cache)
        x, residual = fused_add_rms_norm(x, residual, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, dtype, device)
        self.batch_invariant = False
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        # float32 [max_position, head_dim]: cos | sin, built once (a buffer, not a parameter)
        inv_freq = rope_inv_freq(config).to(self.device)
        self.register_buffer("cos_sin_cache",
                             build_cos_sin_cache(inv_freq, config.max_position_embeddings),
                             persistent=False)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Make every token's computation independent of the batch it rides in (GPU): the
        batch-invariant GEMM for all linears and the LM head, and one attention kernel
        for decode and prefill rows alike (docs/architecture.md, "Numerics")."""
        for module in self.modules():
            if hasattr(module, "batch_invariant"):
                module.batch_invariant = enabled

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the batch."""
        assert len(kv_caches) == len(self.layers), "one (k_cache, v_cache) pair per layer"
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, meta, kv_cache, self.cos_sin_cache)
        x, _ = fused_add_rms_norm(x, residual, self.norm.weight, self.config.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in the model's dtype from hidden states [N, hidden] (typically one
        row per sequence), as Hugging Face computes them; the sampler upcasts where it must."""
        return linear(hidden, self.lm_head_weight, None, self.batch_invariant)
