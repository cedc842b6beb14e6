"""compressed-tensors FP8 checkpoints (llm-compressor's "FP8_DYNAMIC", "FP8" schemes).

config.json:
    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
          "weights": {"num_bits": 8, "type": "float", "strategy": "channel" | "tensor" | "block",
                      "block_structure": [128, 128] (block only), "symmetric": true, "dynamic": false},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
      "ignore": ["lm_head"]}
Tensors: `<layer>.weight` float8_e4m3fn [N, K] and `<layer>.weight_scale` (float32 or bf16:
[N, 1] per channel, one value per tensor, [N / 128, K / 128] per block) with w = weight *
weight_scale; static schemes add `<layer>.input_scale`, unused here (activations are
quantized per token).
"""
from __future__ import annotations

from typing import Any

from slipstream.quant.scheme import Fp8Scheme, check_ignored

METHOD = "compressed-tensors"
FORMATS = ("float-quantized", "naive-quantized")


def parse(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format", "float-quantized")
    if fmt not in FORMATS:
        raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} is not FP8; "
                         f"supported: {', '.join(FORMATS)}")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("quantization_config: compressed-tensors needs exactly one config group "
                         f"(one FP8 scheme for every Linear), got {len(groups) if isinstance(groups, dict) else groups!r}")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise ValueError(f"quantization_config: compressed-tensors weights of {w.get('num_bits')} bits, "
                         f"type {w.get('type')!r}: only 8-bit float (FP8) is supported")
    if w.get("symmetric") is False:
        raise ValueError("quantization_config: asymmetric FP8 weights are not supported")
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        block = tuple(w.get("block_structure") or ())
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"quantization_config: block strategy needs block_structure [rows, cols], got {block!r}")
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"quantization_config: compressed-tensors weight strategy {strategy!r}; "
                         "supported: tensor, channel, block")
    check_ignored(METHOD, qc.get("ignore") or ())
    return Fp8Scheme(METHOD, strategy, serialized=True, block=block)
