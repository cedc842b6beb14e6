"""Which model class runs an architecture: the `architectures` name of a config.json (or the
one a GGUF file's metadata maps to) -> the decoder the loader builds."""
from __future__ import annotations

from slipstream.model.gemma3 import Gemma3ForCausalLM
from slipstream.model.llama import LlamaForCausalLM
from slipstream.model.moe import MoEForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The decoder class of `architecture` (a ValueError naming the known ones otherwise)."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"no model class for architecture {architecture!r}; known: "
                         f"{', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[architecture]
