"""SpeculativeConfig: what `speculative_config` asks for, in vLLM's names.

It sits at the config layer (slipstream/config.py holds it in EngineConfig.speculative_config),
so it imports nothing from the package. `from_value` accepts what users write: a dict
(`LLM(speculative_config={...})`), a JSON string (`--speculative-config '{...}'`) or None."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's defaults: with neither bound given, prompt lookup matches 5-grams only
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # the draft model (draft_model) or the EAGLE-3 head (eagle3): a folder or a .gguf file
    model: str | None = None
    # n-gram lengths prompt lookup matches, longest first (ngram only)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # above this many running requests a step runs without speculation
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, "
                             f"got {self.method!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is not used by method 'ngram' "
                                 "(prompt lookup drafts from the request's own tokens)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None:
                    _int_in(name, value, 1, None)
            # one bound given: the other takes its value (vLLM's rule)
            lo, hi = (lo if lo is not None else hi or DEFAULT_PROMPT_LOOKUP,
                      hi if hi is not None else lo or DEFAULT_PROMPT_LOOKUP)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config.model is required by method "
                                 f"{self.method!r}: a folder or a .gguf file")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is used by method 'ngram' only, "
                                     f"not {self.method!r}")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """Parse a dict or a JSON object string (None or "" or "null": no speculation).
        Bad input raises a one-line ValueError naming the key or the value."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {known}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        kwargs = dict(value)
        if kwargs.get("method") is None:
            # vLLM's rule: a draft model unless named otherwise
            if kwargs.get("model") is None:
                raise ValueError(f"speculative_config.method is required: one of {list(METHODS)}")
            kwargs["method"] = "draft_model"
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _int_in(name: str, value, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"speculative_config.{name} must be {bound}, got {value!r}")
