"""FP8 weights (docs/fp8.md): the e4m3 arithmetic (fp8.py), the scheme a model's layers follow
(scheme.py) and one parser a checkpoint format (compressed_tensors.py, fbgemm_fp8.py,
fp8_block.py). It sits beside ops in the layering: plain torch, imported by ops and model.
"""
from __future__ import annotations

from typing import Any

from slipstream.quant import compressed_tensors, fbgemm_fp8, fp8_block
from slipstream.quant.fp8 import Fp8Weight
from slipstream.quant.scheme import Fp8Scheme

# the engine's `quantization` values (vLLM's name; "none": the checkpoint decides)
QUANTIZATIONS = ("none", "fp8")
_PARSERS = {compressed_tensors.METHOD: compressed_tensors.parse, fbgemm_fp8.METHOD: fbgemm_fp8.parse,
            fp8_block.METHOD: fp8_block.parse}
# quantizing a bf16/fp16 checkpoint at load: one scale an output row
QUANTIZE_AT_LOAD = Fp8Scheme("fp8", "channel", serialized=False)

__all__ = ["Fp8Scheme", "Fp8Weight", "QUANTIZATIONS", "QUANTIZE_AT_LOAD", "scheme_from_config"]


def scheme_from_config(qc: Any) -> Fp8Scheme | None:
    """The scheme of a config.json's `quantization_config` (None: there is none); an
    unsupported method or layout is a one-line ValueError."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in _PARSERS:
        raise ValueError(f"unsupported quantization_config.quant_method {method!r}; supported: "
                         f"{', '.join(_PARSERS)} (FP8 weights)")
    return _PARSERS[method](qc)


def resolve_scheme(checkpoint: Fp8Scheme | None, quantization: str | None) -> Fp8Scheme | None:
    """The scheme a model is built with: the checkpoint's, or with `quantization="fp8"` on an
    unquantized checkpoint, per-channel FP8 quantized at load."""
    q = (quantization or "none").lower()
    if q not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if checkpoint is not None:
        return checkpoint  # an FP8 checkpoint stays FP8 whatever the flag says
    return QUANTIZE_AT_LOAD if q == "fp8" else None
