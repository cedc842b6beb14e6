"""`quant_method: fp8` checkpoints: 128x128 block scales (DeepSeek-V3, Qwen3-*-FP8) or one
scale a tensor (vLLM's own serialized FP8).

config.json (block):
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}
Tensors: `<layer>.weight` float8_e4m3fn [N, K] and `<layer>.weight_scale_inv` float32
[ceil(N / 128), ceil(K / 128)]. Despite its name the scale multiplies: w = weight * scale
over each block. Activations are quantized per token and 128-column group.

Without weight_block_size: `<layer>.weight_scale`, one float32 value a tensor (and, with
activation_scheme "static", an `input_scale`, unused here).
"""
from __future__ import annotations

from typing import Any

from slipstream.quant.scheme import Fp8Scheme, check_ignored

METHOD = "fp8"


def parse(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config: FP8 format {fmt!r}; only e4m3 is supported")
    check_ignored(METHOD, qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme(METHOD, "tensor", serialized=True)
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config: weight_block_size must be [rows, cols], got {block!r}")
    return Fp8Scheme(METHOD, "block", serialized=True, block=(block[0], block[1]),
                     scale_name="weight_scale_inv")
