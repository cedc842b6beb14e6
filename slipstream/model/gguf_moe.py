"""GGUF files of mixture-of-experts models (llama.cpp's `qwen3moe`, and Mixtral as `llama`
with experts): their metadata -> the MoE fields of ModelConfig, their tensor names -> the
Hugging Face names that model/moe.py's loader expects.

llama.cpp stores a layer's experts stacked, one tensor a projection: `blk.{i}.ffn_gate_exps`
and `ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I] (torch order), and the router as
`blk.{i}.ffn_gate_inp` [E, H]. Older Mixtral files hold one tensor an expert instead,
`blk.{i}.ffn_gate.{e}`. Each stacked tensor comes out as E per-expert HF tensors
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe...w1`), so
that tensor parallelism slices each expert's intermediate dimension as for safetensors
(model/shards.py) and only one expert's bytes are dequantized at a time.

llama.cpp renormalises the top-k weights of both families whatever the original config said
(qwen3moe builds its MoE with norm_w on), unless the file says otherwise in
`expert_weights_norm`; that is what a GGUF file means, and what is done here. Shared experts
(`ffn_*_shexp`), sigmoid gating and leading dense layers belong to other families and are
refused by name.
"""
from __future__ import annotations

from typing import Any, Callable, Collection

from slipstream.model.config import ModelConfig
from slipstream.model.moe import EXPERT_NAMES

# stacked GGUF expert tensor -> which of (gate, up, down) it holds
_STACKED = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# one tensor an expert (older Mixtral files): blk.{i}.ffn_gate.{e}.weight
_PER_EXPERT = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2}
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def moe_fields(arch: str, get: Callable[..., Any], tensor_names: Collection[str]) -> dict[str, Any]:
    """The ModelConfig fields of a MoE GGUF file ({} for a dense one); `architecture` among
    them where the GGUF architecture names a dense family (Mixtral's `llama`)."""
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        return {}
    if arch not in ("qwen3moe", "llama"):
        raise ValueError(f"GGUF: mixture of experts in architecture {arch!r} is not supported "
                         "(qwen3moe and llama (Mixtral) are)")
    shared = sorted(n for n in tensor_names if "_shexp" in n)
    if shared or get("expert_shared_count", 0):
        raise ValueError(f"GGUF: shared experts ({shared[0] if shared else 'expert_shared_count'}) "
                         "are not supported (neither Qwen3-MoE nor Mixtral has them)")
    if get("leading_dense_block_count", 0):
        raise ValueError("GGUF: leading_dense_block_count (dense layers before the sparse ones) "
                         "is not supported")
    gating = get("expert_gating_func", _SOFTMAX_GATING)
    if gating != _SOFTMAX_GATING:
        raise ValueError(f"GGUF: expert_gating_func {gating} is not supported (only softmax, 1)")
    fields = dict(num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
                  moe_intermediate_size=int(get("expert_feed_forward_length", None)
                                            or get("feed_forward_length")),
                  norm_topk_prob=bool(get("expert_weights_norm", True)))
    if arch == "llama":
        fields["architecture"] = "MixtralForCausalLM"
    return fields


def expert_hf_names(name: str, config: ModelConfig) -> list[tuple[str, int | None]] | None:
    """The HF tensors of GGUF tensor `name` if it is a MoE block's: (HF name, expert index in
    a stacked tensor or None) for each; None for any other tensor."""
    parts = name.split(".")
    if parts[0] != "blk" or parts[-1] != "weight" or len(parts) not in (4, 5):
        return None
    block, gate, up, down = EXPERT_NAMES[config.architecture]
    prefix = f"model.layers.{parts[1]}.{block}"
    projections = (gate, up, down)
    if len(parts) == 4 and parts[2] == "ffn_gate_inp":
        return [(f"{prefix}.gate.weight", None)]
    if len(parts) == 4 and parts[2] in _STACKED:
        proj = projections[_STACKED[parts[2]]]
        return [(f"{prefix}.experts.{e}.{proj}.weight", e) for e in range(config.num_experts)]
    if len(parts) == 5 and parts[2] in _PER_EXPERT and parts[3].isdigit():
        return [(f"{prefix}.experts.{parts[3]}.{projections[_PER_EXPERT[parts[2]]]}.weight", None)]
    return None
