"""The FP8 KV cache's numbers: per-tensor scales and the torch reference of its rounding.

A layer's K and V caches hold float8_e4m3fn values with one float32 scale each (`KVScales`,
from the checkpoint or 1.0).  Writing stores `sat(x * (1 / scale))`: x multiplied by the
scale's float32 reciprocal and clamped to e4m3's finite range (+-448; torch's cast of a
larger value gives NaN, the GPU's `satfinite` cast saturates, so both clamp first), then
rounded to nearest even.  Reading multiplies the upcast value by the scale: the attention
kernels fold k_scale into the softmax scale and v_scale into the output, which is the same
arithmetic up to float32 rounding (attention is linear in V and the scores are linear in K).

e4m3 keeps 3 mantissa bits: a stored value is within 2^-4 (6.25%) of the scaled input
relatively, for |x / scale| >= 2^-6 (the smallest normal); below that the absolute error is
at most 2^-10 (half the subnormal step 2^-9) times the scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# e4m3's dtype, largest finite value and relative rounding bound: the FP8 weights' own
from slipstream.quant.fp8 import FP8_DTYPE, FP8_MAX
from slipstream.quant.fp8 import REL_ERR as FP8_REL_ERR  # noqa: F401 - the KV tests bound by it

FP8_ABS_ERR = 2.0 ** -10  # half the subnormal step, in units of the scale


@dataclass(frozen=True)
class KVScales:
    """A layer's per-tensor KV cache scales: cache value x scale = the real K or V."""
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (value > 0.0 and value < float("inf")):
                raise ValueError(f"KV cache {name} must be a positive finite number, got {value!r}")

    @property
    def inv_k(self) -> float:
        """1 / k_scale rounded to float32: what the writers multiply by."""
        return _f32(1.0 / self.k_scale)

    @property
    def inv_v(self) -> float:
        return _f32(1.0 / self.v_scale)


UNIT_SCALES = KVScales()


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's dtype (auto) or float8_e4m3fn (fp8 and its
    other spelling fp8_e4m3: vLLM's names, EngineConfig.kv_cache_dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of ['auto', 'fp8', 'fp8_e4m3'], got {kv_cache_dtype!r}")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_ref(x: torch.Tensor, inv_scale: float) -> torch.Tensor:
    """x in float32 times the reciprocal scale, saturated to +-448, cast to e4m3."""
    return (x.float() * inv_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_ref(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """A cache's values in float32 (the real K or V: value x scale); a non-FP8 cache upcast."""
    if not is_fp8(cache):
        return cache.float()
    return cache.float() * scale


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()
