"""An FP8 KV cache's per-layer scales from a safetensors checkpoint.

FP8 checkpoints that calibrated their KV cache carry one float32 scalar each for K and V per
layer (cache value x scale = the real K or V).  The names vary with the tool that wrote them
(vLLM's loader accepts the same): `model.layers.N.self_attn.k_scale` / `.v_scale`
(compressed-tensors with a `kv_cache_scheme`, llm-compressor), `...self_attn.attn.k_scale`,
`...self_attn.k_proj.k_scale` / `...v_proj.v_scale` (ModelOpt), `...k_proj.output_scale` /
`...v_proj.output_scale` (older compressed-tensors), and the deprecated single
`...self_attn.kv_scale` (one scale for both).  A layer without one gets 1.0.  The scales are
per tensor, so every tensor-parallel rank uses them whole.
"""
from __future__ import annotations

import json
import os
import re

from slipstream.model.safetensors_files import safetensors_files
from slipstream.ops.kv_quant import KVScales

# layer index, then which scale: k, v or kv (both)
_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\."
                   r"(?:(?:attn\.)?(k|v|kv)_scale|(k|v)_proj\.(?:(?:k|v)_scale|output_scale))$")


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when `name` is a KV cache scale of a checkpoint, else None
    (the weight loader skips these names: they are not weights)."""
    m = _NAME.match(name)
    if m is None:
        return None
    which = m.group(2) or m.group(3)
    if m.group(3) is not None and not name.endswith(("output_scale", f"{which}_scale")):
        return None  # k_proj.v_scale: not a name any tool writes
    return int(m.group(1)), which


def checkpoint_kv_scales(folder: str, num_layers: int) -> list[KVScales] | None:
    """The per-layer scales a safetensors folder carries (1.0 where a layer has none), or None
    when it carries none.  A `kv_cache_scheme` in config.json's quantization_config must be
    per tensor: other strategies (per head, per token) need kernels this engine lacks."""
    _check_scheme(folder)
    from safetensors import safe_open

    found: dict[int, dict[str, float]] = {}
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                hit = kv_scale_name(name)
                if hit is None:
                    continue
                layer, which = hit
                if layer >= num_layers:
                    raise ValueError(f"{path}: KV cache scale {name!r} names layer {layer} of a "
                                     f"{num_layers}-layer model")
                t = f.get_tensor(name)
                if t.numel() != 1:
                    raise ValueError(f"{path}: KV cache scale {name!r} has {t.numel()} values; only "
                                     "per-tensor scales (one value) are supported")
                for w in ("k", "v") if which == "kv" else (which,):
                    found.setdefault(layer, {})[f"{w}_scale"] = float(t.float().item())
    if not found:
        return None
    return [KVScales(**found.get(i, {})) for i in range(num_layers)]


def set_kv_scales(model, scales: list[KVScales]) -> None:
    """Give each attention layer of `model` its scales (read by `attention_after_qkv`)."""
    layers = list(model.layers)
    if len(layers) != len(scales):
        raise ValueError(f"{len(scales)} KV scale pairs for {len(layers)} layers")
    for layer, sc in zip(layers, scales):
        layer.self_attn.kv_scales = sc


def load_kv_scales(model, source: str, kv_cache_dtype: str,
                   load_format: str = "auto") -> list[KVScales] | None:
    """With an FP8 cache, the checkpoint's scales into `model` (None and nothing set when the
    cache is not FP8, the weights are not read from the source (dummy weights: a folder with
    a config.json only), the source is not a safetensors folder, or it carries no scales)."""
    if kv_cache_dtype == "auto" or load_format == "dummy" or not _has_safetensors(source):
        return None
    scales = checkpoint_kv_scales(source, len(model.layers))
    if scales is not None:
        set_kv_scales(model, scales)
    return scales


def _has_safetensors(source: str) -> bool:
    return os.path.isdir(source) and any(name.endswith((".safetensors", ".safetensors.index.json"))
                                         for name in os.listdir(source))


def _check_scheme(folder: str) -> None:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        quant = (json.load(f).get("quantization_config") or {})
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, dict) else None
    if isinstance(scheme, dict) and scheme.get("strategy", "tensor") != "tensor":
        raise ValueError(f"{path}: kv_cache_scheme strategy {scheme.get('strategy')!r} is not supported; "
                         "the FP8 KV cache takes per-tensor scales")
