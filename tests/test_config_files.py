"""A broken config.json is a one-line ValueError naming the file, raised by slipstream before
transformers reads the folder for its tokenizer (issue 48): missing keys, zero heads, wrong
types, `architectures` as a string, not UTF-8, not an object, a yarn `rope_scaling` beside
`rope_parameters` (refused by name, not dropped)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from slipstream.model.config import ModelConfig


def _edit(cfg: dict, **changes) -> dict:
    cfg = dict(cfg)
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


_DROP = object()

VARIANTS = [
    (dict(vocab_size=_DROP), "the key 'vocab_size' is missing"),
    (dict(num_attention_heads=0), "num_attention_heads must be a positive int, got 0"),
    (dict(hidden_size="64"), "hidden_size must be a positive int, got '64'"),
    (dict(architectures="LlamaForCausalLM"), "architectures must be a list of names"),
    (dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
          rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope scaling type 'yarn'"),
]


@pytest.fixture
def folder(tokenized_tiny, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tokenized_tiny, target)
    return target


def _base(folder) -> dict:
    with open(folder / "config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("changes, words", VARIANTS)
def test_a_broken_config_is_named_before_transformers_reads_it(folder, changes, words):
    from slipstream import LLM
    (folder / "config.json").write_text(json.dumps(_edit(_base(folder), **changes)))
    with pytest.raises(ValueError) as e:
        LLM(str(folder), device="cpu")
    assert str(folder / "config.json") in str(e.value) and words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content, words", [(b"\xff\xfe{}", "is not UTF-8 text"), (b"[1, 2]", "must hold a JSON object"),
                                            (b"{", "is not valid JSON")])
def test_a_config_that_is_not_a_json_object_is_named(tmp_path, content, words):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_json_file(path)
    assert str(path) in str(e.value)


def test_a_legacy_rope_scaling_beside_default_rope_parameters_applies(folder):
    cfg = _edit(_base(folder), rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                rope_scaling={"rope_type": "linear", "factor": 2.0})
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    assert ModelConfig.from_json_file(path).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert os.path.exists(path)


def test_a_config_too_large_to_build_is_a_one_line_error(tmp_path):
    from slipstream import LLM
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=10 ** 12)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="the model does not fit in cpu memory") as e:
        LLM(str(path), load_format="dummy", device="cpu")
    assert "max_position_embeddings" in str(e.value) and "\n" not in str(e.value)
