"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Plain PyTorch over a flat batch of tokens: `input_ids [T]` holds the new tokens of every
sequence of the batch back to back, `meta` says where each sequence starts and how long its
context is, and each layer writes its new K/V into the paged cache before attending over it.
q/k/v and gate/up are merged into one weight each, so each is a single matmul.

The forward pass is CUDA-graph capturable: no host syncs, no branching on tensor values, no
data-dependent shapes, no state kept between calls other than the caches passed in.
Parameter names mirror Hugging Face's without the leading "model." (see loader.py).

Folded norms. A layer's two RMSNorms feed one GEMM each (qkv, gate_up), and
rmsnorm(h) W^T = rstd(h) * (h (W diag(gamma))^T) for a per-row scalar rstd(h). So after
loading, `fold_norms` multiplies gamma into the columns of W_qkv and W_gate_up, the GEMMs
read the residual stream h itself, and the kernel after each GEMM (qkv epilogue, SiLU·mul)
computes rstd(h) per row and scales by it. The residual adds go into the o / down GEMMs
(`linear_add_`: cuBLAS with beta = 1, h updated in place). A layer is then 4 GEMMs and 3
small kernels (epilogue, attention, SiLU·mul) with no norm or add kernel of its own; only
the final norm remains. At one row (the GEMV, ops/linear.py) the row scale is applied
inside the qkv and gate_up products and SiLU·mul inside the down product, and the rest of
the epilogue runs inside the decode attention kernel (`attention_after_qkv`): 5 kernels a
layer. The rounding differs from transformers' (normalised x rounded to bf16, times
gamma, rounded; the sum rounded twice) by about one bf16 step: the tests hold us to
transformers' logits within their tolerances.

Tensor parallelism (`tp`, slipstream.model.parallel): qkv and gate_up are column-parallel
(each rank holds its heads' rows, its slice of the intermediate columns), o and down are
row-parallel (`RowParallelLinear`: rank 0 adds the residual inside its GEMM, the others
write their partial product over their copy of h, and one all-reduce sums them), the
embedding and the LM head are vocab-parallel. Without `tp` none of these classes is used.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.model.config import ModelConfig
from slipstream.model.fp8_layers import Fp8Linear, Fp8RowParallelLinear
from slipstream.model.parallel import TPGroup, TPShard
from slipstream.ops.attention import attention_after_qkv
from slipstream.ops.kv_quant import KVScales
from slipstream.ops.metadata import AttentionMetadata, QKVEpilogue
from slipstream.ops.fused import build_cos_sin_cache, rms_norm, silu_and_mul
from slipstream.ops.linear import linear, linear_add_, linear_into_, norm_linear, silu_mul_linear_add_


def empty_parameter(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); weights are filled by the loader, so they are not initialised here."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = empty_parameter((out_features, in_features), dtype, device)
        self.bias = empty_parameter((out_features,), dtype, device) if bias else None
        self.batch_invariant = False  # set by LlamaForCausalLM.set_batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.batch_invariant)

    def norm_forward(self, h: torch.Tensor, eps: float) -> tuple[torch.Tensor, bool]:
        """`ops.linear.norm_linear`'s (y, finished) for this layer (its norm folded in)."""
        return norm_linear(h, self.weight, self.bias, eps, self.batch_invariant)

    @torch.no_grad()
    def fold_input_scale(self, gamma: torch.Tensor) -> None:
        """Multiply `gamma` (a norm's weight) into the weight's columns."""
        w = self.weight
        w.copy_((w.float() * gamma.float()[None, :]).to(w.dtype))

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += self(x), in place (the residual add inside the GEMM)."""
        return linear_add_(out, x, self.weight, self.bias, self.batch_invariant)

    def add_silu_mul_into(self, out: torch.Tensor, gate_up: torch.Tensor, hidden: torch.Tensor | None,
                          eps: float) -> torch.Tensor:
        """out += self(silu_and_mul(gate_up, hidden, eps)), in place (bias-free: the MLP's down)."""
        return silu_mul_linear_add_(out, gate_up, self.weight, hidden, eps, self.batch_invariant)


class RowParallelLinear(Linear):
    """A linear whose input features are split over the ranks; `add_into` sums the ranks'
    partial products into the residual stream, which is replicated on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, tp: TPGroup):
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += x W^T (+ b) over all ranks: the residual (and bias) added once, by rank 0."""
        if self.tp.rank == 0:
            linear_add_(out, x, self.weight, self.bias, self.batch_invariant)
        elif self.batch_invariant and x.is_cuda:
            out.copy_(linear(x, self.weight, None, True))
        else:
            linear_into_(out, x, self.weight)
        return self.tp.all_reduce(out)

    def add_silu_mul_into(self, out: torch.Tensor, gate_up: torch.Tensor, hidden: torch.Tensor | None,
                          eps: float) -> torch.Tensor:
        return self.add_into(out, silu_and_mul(gate_up, hidden=hidden, eps=eps))


def make_linear(in_features: int, out_features: int, bias: bool, dtype, device, config: ModelConfig,
                tp: TPGroup | None = None, row_parallel: bool = False) -> nn.Module:
    """A decoder projection: FP8 when the config has a quantization scheme (model/fp8_layers.py),
    row-parallel (its input features split) when `row_parallel` under tensor parallelism."""
    scheme = config.quantization
    split = row_parallel and tp is not None
    if scheme is None:
        if split:
            return RowParallelLinear(in_features, out_features, bias, dtype, device, tp)
        return Linear(in_features, out_features, bias, dtype, device)
    if split:
        return Fp8RowParallelLinear(in_features, out_features, bias, dtype, device, scheme, tp)
    return Fp8Linear(in_features, out_features, bias, dtype, device, scheme)


class Embedding(nn.Module):
    def __init__(self, num: int, size: int, dtype, device):
        super().__init__()
        self.weight = empty_parameter((num, size), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """Each rank holds `vocab_per_rank` rows; ids outside them look up zeros, and an
    all-reduce assembles the full embedding on every rank."""

    def __init__(self, tp: TPGroup, size: int, dtype, device):
        super().__init__(tp.shard.vocab_per_rank, size, dtype, device)
        self.tp = tp
        self.start = tp.shard.vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


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
    def __init__(self, config: ModelConfig, dtype, device, tp: TPGroup | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        if tp is not None:  # this rank's heads
            self.num_heads, self.num_kv_heads = tp.shard.num_heads, tp.shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = config.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        self.qkv_proj = make_linear(hidden, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device, config)
        self.o_proj = make_linear(self.q_size, hidden, config.o_bias, dtype, device, config, tp, row_parallel=True)
        self.qk_norm = config.qk_norm
        self.batch_invariant = False
        self.window: int | None = None  # this layer's sliding window, set by the model
        # an FP8 KV cache's per-tensor scales (model/kv_scales.py sets the checkpoint's; None: 1.0)
        self.kv_scales: KVScales | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, dtype, device)

    def forward(self, h, positions, meta: AttentionMetadata, kv_cache, cos_sin_cache):
        """Adds attention's output into the residual stream h (in place)."""
        num_tokens = h.shape[0]
        # the input norm is folded into the qkv weights; its row scale and the bias come after
        # the product: inside it at one row (`norm_linear`), else in the epilogue
        proj = self.qkv_proj
        qkv, finished = proj.norm_forward(h, self.eps)
        k_cache, v_cache = kv_cache
        # (row scale + bias,) q/k norm (Qwen3), RoPE, KV-cache store, then attention: on CUDA
        # the epilogue kernel and the attention kernels, or for a small decode batch one
        # kernel for both; the torch references on CPU
        epi = QKVEpilogue(positions, cos_sin_cache,
                          q_norm_weight=self.q_norm.weight if self.qk_norm else None,
                          k_norm_weight=self.k_norm.weight if self.qk_norm else None,
                          eps=self.eps, hidden=None if finished else h,
                          bias=None if finished else proj.bias)
        out = attention_after_qkv(qkv, epi, k_cache, v_cache, meta, self.scale, self.num_heads,
                                  self.num_kv_heads, self.head_dim, self.batch_invariant, self.window,
                                  self.kv_scales)
        return self.o_proj.add_into(h, out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device, tp: TPGroup | None = None):
        super().__init__()
        hidden = config.hidden_size
        inter = config.intermediate_size if tp is None else tp.shard.intermediate_size
        self.eps = config.rms_norm_eps
        self.gate_up_proj = make_linear(hidden, 2 * inter, False, dtype, device, config)
        self.down_proj = make_linear(inter, hidden, False, dtype, device, config, tp, row_parallel=True)

    def forward(self, h):
        """Adds the MLP's output into the residual stream h (in place); the post-attention
        norm is folded into the gate_up weights, its row scale applied inside that product at
        one row, else by SiLU·mul; at one row SiLU·mul runs inside the down product."""
        gate_up, finished = self.gate_up_proj.norm_forward(h, self.eps)
        return self.down_proj.add_silu_mul_into(h, gate_up, None if finished else h, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device, tp: TPGroup | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, dtype, device)
        self.self_attn = Attention(config, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, dtype, device)
        self.mlp = MLP(config, dtype, device, tp)

    def forward(self, h, positions, meta, kv_cache, cos_sin_cache):
        """Updates the residual stream h in place (norms folded: see the module doc)."""
        self.self_attn(h, positions, meta, kv_cache, cos_sin_cache)
        return self.mlp(h)

    def fold_norms(self) -> None:
        """Multiply each norm's weight into the columns of the GEMM it feeds (once)."""
        fold_norm(self.input_layernorm, self.self_attn.qkv_proj)
        fold_norm(self.post_attention_layernorm, self.mlp.gate_up_proj)


def fold_norm(norm: RMSNorm, proj: Linear) -> None:
    """Multiply `norm`'s weight into the columns of `proj`, the GEMM it feeds; the norm keeps
    only its statistic (weight 1), which the kernel after the GEMM applies."""
    proj.fold_input_scale(norm.weight)
    norm.weight.fill_(1.0)


class LlamaForCausalLM(nn.Module):
    layer_class = DecoderLayer  # a model of other layers (model/moe.py) names its own

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, tp: TPGroup | None = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp  # None: one rank, the whole model
        self.shard: TPShard | None = tp.shard if tp is not None else None
        self.num_local_kv_heads = config.num_kv_heads if tp is None else tp.shard.num_kv_heads
        if tp is None:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        else:
            self.embed_tokens = VocabParallelEmbedding(tp, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(self.layer_class(config, dtype, device, tp) for _ in range(config.num_layers))
        for layer, window in zip(self.layers, config.layer_windows):
            layer.self_attn.window = window
        self.norm = RMSNorm(config.hidden_size, dtype, device)
        self.batch_invariant = False
        self.norms_folded = False  # set by fold_norms, which the loader calls
        if not config.tie_word_embeddings:
            vocab = config.vocab_size if tp is None else tp.shard.vocab_per_rank
            self.lm_head = Linear(config.hidden_size, vocab, False, dtype, device)
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

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Fold every layer's norm weights into its qkv and gate_up weights (module doc);
        the forward pass needs it. Called once, after the weights are loaded."""
        if self.norms_folded:
            raise RuntimeError("the norms are already folded into the weights")
        for layer in self.layers:
            layer.fold_norms()
        self.norms_folded = True

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the batch."""
        assert len(kv_caches) == len(self.layers), "one (k_cache, v_cache) pair per layer"
        assert self.norms_folded, "load weights with slipstream.model.loader (it folds the norms)"
        h = self.embed_tokens(input_ids)  # the residual stream, updated in place by each layer
        for layer, kv_cache in zip(self.layers, kv_caches):
            layer(h, positions, meta, kv_cache, self.cos_sin_cache)
        return rms_norm(h, self.norm.weight, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in the model's dtype from hidden states [N, hidden] (typically one
        row per sequence), as Hugging Face computes them; the sampler upcasts where it must.
        Under tensor parallelism every rank gets the full logits (so all sample alike)."""
        logits = linear(hidden, self.lm_head_weight, None, self.batch_invariant)
        return logits if self.tp is None else self.tp.gather_vocab(logits)
