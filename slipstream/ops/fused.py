"""Element-wise ops the decoder fuses on the GPU: RMSNorm (+ residual), RoPE, SiLU·mul.

Each has a pure-torch reference (the CPU path and the oracle) and a dispatch that uses
the Triton kernel of `slipstream.ops.triton_fused` for CUDA tensors.
Numerics follow Hugging Face's Llama: statistics in float32, results cast back to the
input dtype; the residual sum is rounded to the input dtype before it is normalised.
"""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual) * weight, x + residual)."""
    residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(residual, weight, eps), residual


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


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """float32 [max_position, 2 * len(inv_freq)]: cos | sin of position * inv_freq."""
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rms_norm(x, weight, eps):
    if x.is_cuda:
        from slipstream.ops.triton_fused import rms_norm_triton
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    if x.is_cuda:
        from slipstream.ops.triton_fused import fused_add_rms_norm_triton
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rope(q, k, positions, cos_sin_cache):
    if q.is_cuda:
        from slipstream.ops.triton_fused import rope_triton
        return rope_triton(q, k, positions, cos_sin_cache)
    return rope_ref(q, k, positions, cos_sin_cache)


def silu_and_mul(x):
    if x.is_cuda:
        from slipstream.ops.triton_fused import silu_and_mul_triton
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
