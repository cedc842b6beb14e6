"""What the decoder needs to know about a model, from a Hugging Face config.json or GGUF metadata.

One `ModelConfig` covers the Llama family this engine runs: Llama 2/3/3.1, Mistral, Qwen2 and
Qwen3.  They differ only in a few switches (q/k/v bias, per-head q/k RMSNorm, rope scaling,
tied embeddings, sliding window), which are recorded here so the decoder can stay one file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# architectures name -> (q/k/v bias by default, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES (plus its parameters), or
    # {"rope_type": "freq_factors", "factors": [...]} (GGUF files of Llama 3.1 store these).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    dtype: str | None = None  # the checkpoint's dtype as the config states it ("bfloat16", ...)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None  # the engine caps the context length to it

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.eos_token_id
        if eos is None:
            return set()
        return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}

    @property
    def max_model_len(self) -> int:
        """Longest context the engine may use: the position limit, capped by the sliding window."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def validate(self) -> "ModelConfig":
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) is not a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        _check_rope_scaling(self.rope_scaling)
        return self

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of a Hugging Face config.json (transformers 4.x or 5.x keys)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(
                "config.json has no 'architectures' entry; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise ValueError(f"config.json: architectures must be a list of names, e.g. "
                             f"[\"LlamaForCausalLM\"], got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in config.json; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {arch}; only 'silu' is supported")
        if cfg.get("mlp_bias"):
            raise ValueError(f"unsupported mlp_bias=true for {arch}")

        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        for name, value in (("hidden_size", hidden), ("num_attention_heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers 5 keeps rope settings in `rope_parameters`; older files use
        # top-level `rope_theta` and `rope_scaling`.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope_params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        # a legacy rope_scaling beside rope_parameters that say nothing of scaling still applies
        # (or is refused by name, e.g. yarn): it is never dropped silently
        scaling = (_normalize_rope_scaling(rope_params)
                   or _normalize_rope_scaling(dict(cfg.get("rope_scaling") or {})))
        if scaling is not None and scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("unsupported rope: partial_rotary_factor != 1")

        attention_bias = cfg.get("attention_bias", default_bias)
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(attention_bias)

        if arch.startswith("Qwen"):
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        else:
            window = cfg.get("sliding_window")

        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            dtype=str(dtype) if dtype else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            sliding_window=int(window) if window else None,
        ).validate()

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """The config of a config.json; every problem is a one-line ValueError naming the file
        (missing keys, zero or wrongly typed sizes, not UTF-8, not JSON)."""
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
        try:
            return cls.from_hf_config(cfg)
        except KeyError as e:
            raise ValueError(f"{path}: the key {e} is missing") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: {e}") from None


def _normalize_rope_scaling(scaling: dict[str, Any]) -> dict[str, Any] | None:
    if not scaling:
        return None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return None
    scaling = {"rope_type": rope_type, **scaling}
    _check_rope_scaling(scaling)
    return scaling


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type == "freq_factors":
        return
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: "
                         f"{', '.join(repr(t) for t in SUPPORTED_ROPE_TYPES)}")
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings")}.get(rope_type, ())
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} lacks {', '.join(missing)}")
