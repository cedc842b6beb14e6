"""speculative_config: vLLM's keys parsed from a dict or a JSON string, one-line errors for
bad input, and the EngineConfig field that carries it through the core's JSON hand-off."""
from __future__ import annotations

import dataclasses
import json

import pytest

from slipstream.config import EngineConfig
from slipstream.spec.config import SpeculativeConfig


def test_ngram_defaults_follow_vllm():
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 7})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    c = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 2, '
                                     '"prompt_lookup_min": 1, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (2, 1, 4)


def test_models_methods_and_empty_values():
    c = SpeculativeConfig.from_value({"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 3,
                                      "disable_by_batch_size": 8})
    assert (c.method, c.model, c.disable_by_batch_size) == ("eagle3", "/heads/e3", 8)
    # vLLM's rule: a model without a method is a draft model
    assert SpeculativeConfig.from_value({"model": "m", "num_speculative_tokens": 2}).method == "draft_model"
    for empty in (None, "", "  ", "null"):
        assert SpeculativeConfig.from_value(empty) is None
    assert SpeculativeConfig.from_value(c) is c


@pytest.mark.parametrize("value, words", [
    ('{"method": "ngram"', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}, "unknown speculative_config key(s) ['draft_tp']"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle-3", "model": "m", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, "model is not used by method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required by method 'draft_model'"),
    ({"method": "eagle3", "model": "m", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max is used by method 'ngram' only"),
    ({"num_speculative_tokens": 2}, "method is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
])
def test_bad_values_raise_one_line_errors_naming_them(value, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_value(value)
    assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError):  # the engine's own parsing says the same
        EngineConfig(speculative_config=value)


def test_the_engine_field_parses_and_survives_the_json_hand_off():
    assert EngineConfig().speculative_config is None
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative_config == SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)
    # the core's process and the workers get the config as JSON of asdict
    back = EngineConfig.from_kwargs(**json.loads(json.dumps(dataclasses.asdict(config))))
    assert back == config
