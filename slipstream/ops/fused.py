"""Element-wise ops the decoder fuses on the GPU: RMSNorm, RoPE, SiLU·mul, and the attention
prologue after the qkv GEMM (row scale + bias, q/k norm + RoPE + KV-cache store, `qkv_epilogue`).

Each has a pure-torch reference (the CPU path and the oracle) and a dispatch that uses
the Triton kernel of `slipstream.ops.triton_fused` for CUDA tensors.
Numerics: statistics in float32, results cast back to the input dtype. The decoder layers'
RMSNorms are folded into the GEMMs after them (model/llama.py, "Folded norms"): their
1 / rms statistic is applied by the kernel after the GEMM (`scale_rows_ref`), in float32.
"""
from __future__ import annotations

import torch

from slipstream.ops.kv_quant import UNIT_SCALES, KVScales, is_fp8, quantize_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def row_rstd_ref(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 [T, 1]: 1 / rms of each row of the residual stream (the RMSNorm statistic)."""
    hf = hidden.float()
    return torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


def scale_rows_ref(x: torch.Tensor, hidden: torch.Tensor | None, eps: float,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The output of a GEMM whose RMSNorm weight was folded into its weights (model/llama.py,
    "Folded norms"), finished: x * rstd(hidden) (+ bias), rounded once to x's dtype."""
    if hidden is None and bias is None:
        return x
    xf = x.float()
    if hidden is not None:
        xf = xf * row_rstd_ref(hidden, eps)
    if bias is not None:
        xf = xf + bias.float()
    return xf.to(x.dtype)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding of q [T, Hq, D] and k [T, Hk, D].

    cos_sin_cache is float32 [max_position, D] holding cos for the first D/2 columns and
    sin for the last D/2 (one frequency per pair (j, j + D/2)).  Returns new tensors.
    """
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul_ref(x: torch.Tensor, hidden: torch.Tensor | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I].

    With `hidden` [T, H] (the residual stream the gate_up GEMM read, its norm weight folded
    into the GEMM's weights), gate and up are first scaled by rstd(hidden) in float32."""
    gate, up = x.chunk(2, dim=-1)
    g, u = gate.float(), up.float()
    if hidden is not None:
        r = row_rstd_ref(hidden, eps)
        g, u = g * r, u * r
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into their cache slots; an FP8 cache
    stores them quantized with `kv_scales` (1.0 when None: `ops/kv_quant.py`)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if is_fp8(k_cache):
        sc = kv_scales or UNIT_SCALES
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_ref(k[keep], sc.inv_k)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_ref(v[keep], sc.inv_v)
        return
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """float32 [max_position, 2 * len(inv_freq)]: cos | sin of position * inv_freq."""
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def qkv_epilogue_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     num_heads: int, num_kv_heads: int, head_dim: int,
                     q_norm_weight: torch.Tensor | None = None,
                     k_norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6, hidden: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None,
                     kv_scales: KVScales | None = None) -> torch.Tensor:
    """Everything between the qkv GEMM and attention, composed from the references.

    qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] = [q heads | k heads | v heads].
    With `hidden` (the residual stream the GEMM read; the input norm's weight folded into
    the qkv weights) and / or `bias`, qkv is first finished by `scale_rows_ref`.
    Per token: q and k heads get a per-head RMSNorm when their weights are given (Qwen3's
    q_norm / k_norm, `rms_norm_ref` over head_dim), then neox RoPE (`rope_ref`); k and v are
    written into the paged cache at slot_mapping[t] (-1: skipped; `store_kv_ref`, which
    quantizes them with `kv_scales` into an FP8 cache).
    Returns the rotated q as a new contiguous tensor [T, num_heads, head_dim]; qkv is not
    modified.  This is the CPU path and the oracle of `qkv_epilogue_triton`.
    """

    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert qkv.shape[-1] == q_size + 2 * kv_size, "qkv width != (num_heads + 2 * num_kv_heads) * head_dim"
    qkv = scale_rows_ref(qkv, hidden, eps, bias)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if q_norm_weight is not None:
        q = rms_norm_ref(q.reshape(-1, head_dim), q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm_ref(k.reshape(-1, head_dim), k_norm_weight, eps)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    q, k = rope_ref(q, k, positions[:num_tokens], cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping[:num_tokens], kv_scales)
    return q


def rms_norm(x, weight, eps):
    if x.is_cuda:
        from slipstream.ops.triton_fused import rms_norm_triton
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def silu_and_mul(x, hidden=None, eps=1e-6):
    if x.is_cuda:
        from slipstream.ops.triton_fused import silu_and_mul_triton
        return silu_and_mul_triton(x, hidden=hidden, eps=eps)
    return silu_and_mul_ref(x, hidden, eps)


def qkv_epilogue(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                 num_heads, num_kv_heads, head_dim, q_norm_weight=None, k_norm_weight=None,
                 eps=1e-6, hidden=None, bias=None, batch_invariant=False, kv_scales=None):
    """(row scale + bias,) q/k norm + RoPE + KV store after the qkv GEMM; returns q
    [T, num_heads, head_dim].

    CUDA: one Triton kernel that writes q IN PLACE into the q part of `qkv` and returns a
    strided view of it (last dim contiguous); qkv's contents are consumed.  CPU: the
    reference, which returns a new tensor and leaves qkv alone.  Callers must use the
    returned q and must not rely on qkv afterwards.  `kv_scales`: an FP8 cache's scales.
    """
    if qkv.is_cuda:
        from slipstream.ops import triton_attention
        from slipstream.ops.triton_qkv_epilogue import qkv_epilogue_triton
        # loads before the PDL wait at the decode kernel's small batches (one knob for both)
        prefetch = triton_attention.DEFAULT_DECODE_CONFIG.prefetch_batch
        return qkv_epilogue_triton(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                   num_heads, num_kv_heads, head_dim, q_norm_weight,
                                   k_norm_weight, eps, hidden=hidden, bias=bias,
                                   batch_invariant=batch_invariant, prefetch_tokens=prefetch,
                                   kv_scales=kv_scales)
    return qkv_epilogue_ref(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                            num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, eps,
                            hidden=hidden, bias=bias, kv_scales=kv_scales)
