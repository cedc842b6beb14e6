"""The decoder against Hugging Face transformers on the same weights (fp32, CPU).

Tiny random models of each family (Llama, Llama 3.1 rope scaling, Mistral and Gemma 3 with
sliding windows shorter than the prompts, Qwen2, Qwen3):
logits on a prompt and a prefill split in two chunks over a cached prefix (batched with another
sequence); then the embedded SmolLM2 GGUF against transformers loading the same file.  Greedy
generation against `generate` goes through the engine: tests/test_engine.py.
"""
import pytest
import torch
from helpers import TINY_MODELS, PagedModelRunner, hf_logits, smollm2

from slipstream.model.loader import load_model
from slipstream.model.llama import rope_inv_freq


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor):
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale)


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def family(request, tiny_model):
    folder, hf = tiny_model(request.param)
    model, config = load_model(folder)
    return hf, model, config


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def test_logits_match_hf(family):
    hf, model, _ = family
    prompt = _prompt(40, 0)
    ours = PagedModelRunner(model).step([(0, prompt)])
    assert_logits_close(ours, hf_logits(hf, prompt))


def test_chunked_prefill_over_cached_prefix(family):
    hf, model, _ = family
    prompt, other = _prompt(37, 1), _prompt(11, 2)
    ref, ref_other = hf_logits(hf, prompt), hf_logits(hf, other)
    runner = PagedModelRunner(model, block_size=4)
    first = runner.step([(0, prompt[:18])])
    # the second chunk attends to the cached 18 tokens; another sequence shares the batch
    batch = [(0, prompt[18:]), (1, other)]
    second = runner.step(batch)
    assert_logits_close(first, ref[:18])
    assert_logits_close(second[:19], ref[18:])
    assert_logits_close(second[19:], ref_other)


def test_llama3_rope_scaling_changes_frequencies(family):
    _, model, config = family
    inv = rope_inv_freq(config)
    assert inv.shape == (config.head_dim // 2,)
    plain = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).double() / config.head_dim)
    if config.rope_scaling:  # llama3: highest frequency kept, lowest divided by the factor
        assert inv[0].item() == pytest.approx(plain[0].item())
        assert inv[-1].item() == pytest.approx(plain[-1].item() / config.rope_scaling["factor"])
    else:
        torch.testing.assert_close(inv.double(), plain)


def test_mistral_window_shorter_than_the_prompt_is_applied(tiny_model):
    """transformers' Mistral applies its 16-key window to a 40-token prompt (the logits differ
    from the same weights with the window off), and ours follow the windowed ones, over a
    prefill and over decode steps far past the window."""
    folder, hf = tiny_model("mistral")
    model, config = load_model(folder)
    assert config.layer_windows == [16] * config.num_layers
    prompt = _prompt(40, 3)
    windowed = hf_logits(hf, prompt)
    hf.config.sliding_window = None
    try:
        unwindowed = hf_logits(hf, prompt)
    finally:
        hf.config.sliding_window = 16
    assert (windowed[16:] - unwindowed[16:]).abs().max() > 1e-2  # the window changes them
    assert_logits_close(windowed[:16], unwindowed[:16])  # not before it fills
    runner = PagedModelRunner(model, block_size=4)
    ours = [runner.step([(0, prompt[:30])])]
    ours += [runner.step([(0, [t])]) for t in prompt[30:]]  # decode rows at contexts 31..40
    assert_logits_close(torch.cat(ours), windowed)


@pytest.mark.slow
def test_smollm2_gguf_logits_match_hf(smollm2_transformers):
    model, _, tokenizer = smollm2()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    ours = PagedModelRunner(model, block_size=16).step([(0, prompt)])
    assert_logits_close(ours, hf_logits(smollm2_transformers, prompt))


def test_set_batch_invariant_reaches_every_linear_and_attention(family):
    # The switch flips each Linear, Attention and the LM head; the CPU path is per row
    # already, so its logits stay bitwise the same.
    _, model, _ = family
    prompt = _prompt(20, 3)
    before = PagedModelRunner(model).step([(0, prompt)])
    model.set_batch_invariant(True)
    try:
        flags = [m.batch_invariant for m in model.modules() if hasattr(m, "batch_invariant")]
        # the model, per layer Attention + qkv / o / gate_up / down, an untied LM head
        untied = 0 if model.config.tie_word_embeddings else 1
        assert len(flags) == 1 + 5 * len(model.layers) + untied
        assert all(flags)
        assert torch.equal(PagedModelRunner(model).step([(0, prompt)]), before)
    finally:
        model.set_batch_invariant(False)


def test_norms_are_folded_once_by_the_loader(family):
    # the loader folds each layer's norm weights into the qkv / gate_up weights (the forward
    # pass needs it); folding again would scale the weights twice, so it is refused
    # (Gemma 3's norms fold into themselves: w becomes 1 + w, model/gemma3.py)
    _, model, config = family
    assert model.norms_folded
    assert config.architecture == "Gemma3ForCausalLM" or all(
        torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
        for layer in model.layers)
    with pytest.raises(RuntimeError, match="already folded"):
        model.fold_norms()
