"""The EAGLE-3 draft head (Li et al. 2025), in the layout its checkpoints are published in (the
EAGLE-3 authors' and the `speculators` library's; docs/speculative-decoding.md lists the
tensors). Plain PyTorch over a flat batch of tokens, like model/llama.py, with its one
layer's K/V in a paged cache of the engine's layout.

What it computes, per token t of a sequence:
  * the target's hidden states at three of its layers, concatenated [3 H_target], are fused by
    `fc` into one hidden state g_t [H] (`combine_hidden_states`);
  * its decoder layer reads the concatenation [input_layernorm(embed(x_{t+1})) |
    hidden_norm(g_t)] (2H wide: q/k/v take 2H inputs), attends causally over the sequence's
    earlier positions in its own KV cache, and adds attention and MLP outputs to the residual
    (g_t, or hidden_norm(g_t) with `norm_before_residual`);
  * the final norm and the LM head give logits over the draft vocabulary; `d2t` maps a draft
    id d to the target id d + d2t[d].
The next draft step feeds the layer's pre-norm output back as the hidden state (no `fc`),
with the embedding of the token just drafted: `forward` returns both.

Which target layers: the checkpoint's `eagle_aux_hidden_state_layer_ids` when it names them,
else `default_aux_layers` (2, L // 2, L - 3 of an L-layer target, the field's convention),
each the residual stream entering that layer.

Norms are not folded here (the attention input is two normalised halves), so the head runs
RMSNorm, the GEMMs and SiLU·mul as separate ops; its attention is the engine's
(`attention_after_qkv`: RoPE, KV store, paged attention), CUDA-graph capturable like the
target's forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slipstream.model.config import ModelConfig
from slipstream.model.llama import Embedding, Linear, RMSNorm, rope_inv_freq
from slipstream.ops.attention import attention_after_qkv
from slipstream.ops.fused import build_cos_sin_cache, rms_norm, silu_and_mul
from slipstream.ops.linear import linear
from slipstream.ops.metadata import AttentionMetadata, QKVEpilogue


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose input hidden states an EAGLE-3 head reads, by default."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class AuxHiddenCapture:
    """While active (a `with` block), the target's forward also records the residual stream
    entering each of `layer_ids` (pre-hooks on those layers, which update it in place, so
    each is copied); `aux()` is their concatenation [T, 3 H_target], the head's fc input.
    Works for decoders whose layers take the residual stream as their first argument
    (model/llama.py, model/moe.py); a copy is a kernel, so it is capturable."""

    def __init__(self, target: nn.Module, layer_ids: tuple[int, ...]):
        layers = target.layers
        if any(not 0 <= i < len(layers) for i in layer_ids):
            raise ValueError(f"aux layers {list(layer_ids)} outside the target's {len(layers)} layers")
        self.layers = [layers[i] for i in layer_ids]
        self.parts: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles: list = []

    def __enter__(self) -> AuxHiddenCapture:
        for slot, layer in enumerate(self.layers):
            def hook(module, args, slot=slot):
                self.parts[slot] = args[0].clone()
            self._handles.append(layer.register_forward_pre_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def aux(self) -> torch.Tensor:
        if any(p is None for p in self.parts):
            raise RuntimeError("no forward ran while capturing the target's hidden states")
        return torch.cat(self.parts, dim=-1)


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the decoder layer's shape (a one-layer Llama config)
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool = False
    fc_bias: bool = False  # published heads differ: the loader sets it from the tensors
    aux_layer_ids: tuple[int, ...] | None = None  # None: default_aux_layers of the target

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:  # the target's
        return self.layer.vocab_size

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Eagle3Config:
        """From a head's config.json: the `speculators` form (`transformer_layer_config`) or
        the EAGLE-3 authors' (a Llama config with `draft_vocab_size`). One-line ValueErrors."""
        if not isinstance(cfg, dict):
            raise ValueError(f"an EAGLE-3 config must be a JSON object, got {type(cfg).__name__}")
        speculators = "transformer_layer_config" in cfg
        if speculators and cfg.get("speculators_model_type", "eagle3") != "eagle3":
            raise ValueError(f"not an EAGLE-3 head: speculators_model_type is "
                             f"{cfg.get('speculators_model_type')!r}")
        layer_cfg = dict(cfg["transformer_layer_config"] if speculators else cfg)
        layer_cfg["architectures"] = ["LlamaForCausalLM"]
        layer_cfg["num_hidden_layers"] = 1
        try:
            layer = ModelConfig.from_hf_config(layer_cfg)
        except KeyError as e:
            raise ValueError(f"EAGLE-3 config: the key {e} is missing") from None
        draft_vocab = cfg.get("draft_vocab_size") or layer.vocab_size
        target_hidden = cfg.get("target_hidden_size") or layer.hidden_size
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or \
            (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        for name, value in (("draft_vocab_size", draft_vocab), ("target_hidden_size", target_hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"EAGLE-3 config: {name} must be a positive integer, got {value!r}")
        if draft_vocab > layer.vocab_size:
            raise ValueError(f"EAGLE-3 config: draft_vocab_size ({draft_vocab}) exceeds the target "
                             f"vocabulary ({layer.vocab_size})")
        if aux is not None and (not isinstance(aux, list) or len(aux) != 3
                                or not all(isinstance(i, int) and i >= 0 for i in aux)):
            raise ValueError(f"EAGLE-3 config: eagle_aux_hidden_state_layer_ids must list 3 layer "
                             f"indices, got {aux!r}")
        return cls(layer=layer, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
                   norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                   aux_layer_ids=tuple(aux) if aux else None)

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        ids = self.aux_layer_ids or default_aux_layers(num_target_layers)
        if any(i >= num_target_layers for i in ids):
            raise ValueError(f"EAGLE-3 head reads target layers {list(ids)}, but the target has "
                             f"{num_target_layers} layers")
        return ids


class Eagle3Layer(nn.Module):
    def __init__(self, config: Eagle3Config, dtype, device):
        super().__init__()
        c = config.layer
        self.norm_before_residual = config.norm_before_residual
        self.eps = c.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        self.input_layernorm = RMSNorm(c.hidden_size, dtype, device)
        self.hidden_norm = RMSNorm(c.hidden_size, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, dtype, device)
        # q/k/v merged into one GEMM over [embeds | hidden]
        self.qkv_proj = Linear(2 * c.hidden_size, self.q_size + 2 * self.kv_size, c.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, c.hidden_size, c.o_bias, dtype, device)
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, False, dtype, device)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, False, dtype, device)

    def forward(self, embeds, hidden, positions, meta: AttentionMetadata, kv_cache, cos_sin_cache):
        """The layer's output [T, H] (the residual stream after attention and MLP)."""
        if self.norm_before_residual:
            hidden = rms_norm(hidden, self.hidden_norm.weight, self.eps)
            residual = hidden
        else:
            residual = hidden
            hidden = rms_norm(hidden, self.hidden_norm.weight, self.eps)
        embeds = rms_norm(embeds, self.input_layernorm.weight, self.eps)
        qkv = self.qkv_proj(torch.cat([embeds, hidden], dim=-1))
        k_cache, v_cache = kv_cache
        epi = QKVEpilogue(positions, cos_sin_cache, eps=self.eps)
        attn = attention_after_qkv(qkv, epi, k_cache, v_cache, meta, self.scale, self.num_heads,
                                   self.num_kv_heads, self.head_dim)
        h = residual + self.o_proj(attn.reshape(qkv.shape[0], self.q_size))
        gate_up = self.gate_up_proj(rms_norm(h, self.post_attention_layernorm.weight, self.eps))
        return h + self.down_proj(silu_and_mul(gate_up))


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, dtype: torch.dtype, device, own_embedding: bool = True):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        H = config.hidden_size
        # a head published without embed_tokens shares the target's (`share_embedding`)
        self.embed_tokens = Embedding(config.vocab_size, H, dtype, device) if own_embedding else None
        self.fc = Linear(3 * config.target_hidden_size, H, config.fc_bias, dtype, device)
        self.layer = Eagle3Layer(config, dtype, device)
        self.norm = RMSNorm(H, dtype, device)
        self.lm_head = Linear(H, config.draft_vocab_size, False, dtype, device)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long, device=device))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool, device=device))
        inv_freq = rope_inv_freq(config.layer).to(self.device)
        self.register_buffer("cos_sin_cache",
                             build_cos_sin_cache(inv_freq, config.layer.max_position_embeddings),
                             persistent=False)

    def share_embedding(self, weight: torch.Tensor) -> None:
        """Use the target's embedding table [V_target, H] (heads published without one)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"the target's embedding is {tuple(weight.shape)}, the head needs "
                             f"[{self.config.vocab_size}, {self.config.hidden_size}]")
        self.embed_tokens = Embedding(0, 0, self.dtype, "meta")  # no storage: the target's replaces it
        self.embed_tokens.weight = nn.Parameter(weight, requires_grad=False)

    def combine_hidden_states(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 H_target] (the three target layers' states, concatenated in the order of
        `Eagle3Config.aux_layers`) -> [T, H]: the first draft step's hidden state."""
        return self.fc(aux_hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed [T, H] for `compute_logits`, pre-norm [T, H] for the next draft step)."""
        if self.embed_tokens is None:
            raise RuntimeError("this EAGLE-3 head has no embedding: call share_embedding first")
        embeds = self.embed_tokens(input_ids)
        h = self.layer(embeds, hidden, positions, meta, kv_cache, self.cos_sin_cache)
        return rms_norm(h, self.norm.weight, self.config.layer.rms_norm_eps), h

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [T, V_draft]; `draft_to_target` maps their ids."""
        return linear(normed, self.lm_head.weight)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        ids = draft_ids.long()
        return ids + self.d2t[ids]

    def spread_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, V_draft] -> [T, V_target]: -inf for a target id with no
        draft id, so softmax gives the draft distribution q in the target's ids."""
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        targets = torch.arange(self.config.draft_vocab_size, device=logits.device) + self.d2t
        return out.index_copy_(1, targets, logits)

    def target_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary [T, V_target] (`spread_to_target`)."""
        return self.spread_to_target(self.compute_logits(normed))
