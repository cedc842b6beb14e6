"""What the decoder needs to know about a model, from a Hugging Face config.json or GGUF metadata.

One `ModelConfig` covers the models this engine runs: the Llama family (Llama 2/3/3.1, Mistral,
Qwen2, Qwen3), which differs only in a few switches (q/k/v bias, per-head q/k RMSNorm, rope scaling,
tied embeddings, sliding window), which are recorded here so the decoder can stay one file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from slipstream.quant import Fp8Scheme, scheme_from_config

# architectures name -> (q/k/v bias by default, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    # mixture of experts in place of the MLP (model/moe.py)
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    # its own decoder (model/gemma3.py)
    "Gemma3ForCausalLM": (False, True),
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
    # keys within this many positions of a query (itself included) in the windowed layers
    sliding_window: int | None = None
    # per layer "sliding_attention" or "full_attention"; None: every layer is windowed when
    # sliding_window is set
    layer_types: list[str] | None = None
    # Gemma 3 (model/gemma3.py): the sliding layers' unscaled RoPE base, the attention scale
    # query_pre_attn_scalar ** -0.5, tanh softcapping of the attention scores (refused: the
    # kernels lack it) and of the logits
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # mixture of experts (model/moe.py); num_experts 0: a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's intermediate width
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    # FP8 weights (slipstream/quant, docs/fp8.md): from the checkpoint's quantization_config,
    # or set by the loader for `quantization="fp8"`; None: the checkpoint's dtype
    quantization: Fp8Scheme | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
        """Longest context the engine may use: the position limit (windowed layers attend to
        the last sliding_window keys of any context)."""
        return self.max_position_embeddings

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        if not self.sliding_window:
            return [None] * self.num_layers
        types = self.layer_types or ["sliding_attention"] * self.num_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has it (KV blocks behind it are dead), else None."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers or not set(
                self.layer_types) <= {"sliding_attention", "full_attention"}):
            raise ValueError(f"model config: layer_types must list 'sliding_attention' or "
                             f"'full_attention' for each of the {self.num_layers} layers")
        if self.attn_logit_softcapping is not None:  # no Gemma 3 checkpoint sets it
            raise ValueError("model config: attn_logit_softcapping is not supported (the attention "
                             "kernels do not softcap scores)")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) must be "
                             f"in 1..num_experts ({self.num_experts})")
        if self.is_moe and self.moe_intermediate_size <= 0:
            raise ValueError(f"model config: moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        return self

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of a Hugging Face config.json (transformers 4.x or 5.x keys)."""
        archs = cfg.get("architectures") or []
        if archs and archs[0] == "Gemma3ForCausalLM":
            cfg = gemma3_flat_config(cfg)
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
        layer_types = cfg.get("layer_types")

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
            layer_types=list(layer_types) if layer_types else None,
            quantization=scheme_from_config(cfg.get("quantization_config")),
            **_moe_fields(arch, cfg),
            **{k: cfg[k] for k in GEMMA3_FIELDS if arch == "Gemma3ForCausalLM"},
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


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE or Mixtral config.json ({} otherwise).
    Every layer is sparse and there are no shared experts in either family; other layouts
    are refused by name."""
    if arch == "Qwen3MoeForCausalLM":
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise ValueError(f"unsupported {arch}: decoder_sparse_step != 1 or mlp_only_layers "
                             "(dense layers among the sparse ones)")
        return dict(num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                    num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if arch == "MixtralForCausalLM":  # always renormalises its top-k weights
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    return {}


GEMMA3_FIELDS = ("rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping")


def gemma3_flat_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config.json in the keys the parser reads: the full layers' RoPE (with its
    scaling) as rope_theta / rope_scaling, the sliding layers' base as rope_local_theta,
    layer_types from sliding_window_pattern when absent, and Gemma's own fields."""
    cfg = dict(cfg)
    act = cfg.pop("hidden_activation", None) or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_activation {act!r} for Gemma3ForCausalLM; "
                         "only 'gelu_pytorch_tanh' is supported")
    cfg["hidden_act"] = "silu"  # the parser's own check; model/gemma3.py runs GELU-tanh
    rope = dict(cfg.pop("rope_parameters", None) or {})
    full = dict(rope.get("full_attention") or cfg.get("rope_scaling") or {})
    local = dict(rope.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError("unsupported rope scaling of Gemma 3's sliding layers")
    cfg["rope_theta"] = full.pop("rope_theta", None) or cfg.get("rope_theta") or 1_000_000.0
    cfg["rope_scaling"] = full
    cfg["rope_local_theta"] = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0)
    if cfg.get("layer_types") is None:
        pattern = cfg.get("sliding_window_pattern") or 6
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention=true for Gemma3ForCausalLM")
    cfg["query_pre_attn_scalar"] = float(cfg.get("query_pre_attn_scalar") or 256)
    cfg["attn_logit_softcapping"] = cfg.get("attn_logit_softcapping")
    cfg["final_logit_softcapping"] = cfg.get("final_logit_softcapping")
    cfg.setdefault("tie_word_embeddings", True)
    return cfg


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
