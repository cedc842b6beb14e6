"""fbgemm FP8 checkpoints (Meta's Llama 3.1 FP8 releases; transformers' FbgemmFp8 quantizer).

config.json:
    "quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                            "modules_to_not_convert": [...]}
Tensors: `<layer>.weight` float8_e4m3fn [N, K] and `<layer>.weight_scale` float32 [N, 1],
one scale an output row, w = weight * weight_scale. fbgemm bounds each token's activation
scale by activation_scale_ub; the per-token quantization here takes each token's own amax.
"""
from __future__ import annotations

from typing import Any

from slipstream.quant.scheme import Fp8Scheme, check_ignored

METHOD = "fbgemm_fp8"


def parse(qc: dict[str, Any]) -> Fp8Scheme:
    check_ignored(METHOD, qc.get("modules_to_not_convert") or ())
    return Fp8Scheme(METHOD, "channel", serialized=True)
