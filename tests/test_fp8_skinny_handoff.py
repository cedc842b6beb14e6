"""The skinny FP8 GEMM handing its output to the next product already quantized
(ops/triton_fp8_gemm_skinny.py: `quant_out`, a `QuantizedRows` input): the codes and scales a
producer writes in its epilogue are those of `quantize_rows` on its stored output, bit for
bit, and a consumer multiplies per-group scaled inputs as the reference does.

On the CPU under Triton's interpreter at tiny sizes (tests/conftest.py); the default launches'
compiled code is checked by tests/test_fp8_gemm_mid.py's sm_90 compile test.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_rms
from test_fp8_kernels import _weight

from slipstream.ops.triton_fp8_gemm_skinny import Fp8SkinnyConfig, fp8_gemm_skinny
from slipstream.ops.triton_fp8_quant import quantize_rows
from slipstream.quant.fp8 import QuantizedRows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(block_n=16, block_m=16, block_k=32)
PRODUCER = dict(TINY, block_n=32)  # its output groups are its tiles' columns: an FP8 MMA's K step


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[:, ::29] *= 20  # outlier channels, as real activations have
    return x.to(torch.bfloat16).to(DEVICE)


def _gamma(n: int) -> torch.Tensor:
    return (torch.rand(n, generator=torch.Generator().manual_seed(5)) + 0.5).to(DEVICE)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("m", [3, 19])
def test_a_producer_writes_the_codes_of_its_stored_output(split_k, m):
    """down-like: K = 96 in 3 steps, 96 outputs in 3 tiles of 32 (three groups a row), the
    residual in place; rows in one or two tiles."""
    w = _weight(96, 96, None, False)
    x, res, gamma = _x(m, 96), _x(m, 96, seed=3), _gamma(96)
    cfg = Fp8SkinnyConfig(**PRODUCER, split_k=split_k)
    plain = fp8_gemm_skinny(x, w, None, cfg, residual=res.clone())
    h = res.clone()
    out, quantized = fp8_gemm_skinny(x, w, None, cfg, residual=h, out=h, quant_out=gamma)
    assert out is h and torch.equal(h, plain)  # the output is unchanged by the handoff
    q, s = quantize_rows(h, gamma, group=32)
    assert quantized.group == 32 and quantized.dtype == torch.bfloat16
    assert quantized.scale.shape == (m, 3) and torch.equal(quantized.scale, s)
    assert torch.equal(quantized.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("m", [3, 19])
def test_a_consumer_multiplies_group_scaled_inputs(split_k, m):
    """qkv-like: per-channel weights, the input in 32-column groups (the K step), K = 160."""
    w = _weight(48, 160, None, False)
    x = _x(m, 160)
    q, s = quantize_rows(x, None, group=32)
    y = fp8_gemm_skinny(QuantizedRows(q, s, 32, torch.bfloat16), w, None, Fp8SkinnyConfig(**TINY, split_k=split_k))
    dq = q.float() * s.repeat_interleave(32, 1)
    ref = F.linear(dq, w.dequantized(torch.float32))
    assert y.shape == (m, 48) and y.dtype == torch.bfloat16
    assert rel_rms(y.float(), ref) < 2 ** -8  # the same FP8 operands: bf16 output rounding


def test_a_handoff_chain_equals_quantizing_in_between():
    """o -> gate_up: the producer's codes feed the consumer, which then gives the bits of the
    same product fed by `quantize_rows` on the producer's output."""
    w_o, w_up = _weight(64, 96, None, False), _weight(80, 64, None, False)
    x, res, gamma = _x(19, 96), _x(19, 64, seed=3), _gamma(64)
    h, handed = fp8_gemm_skinny(x, w_o, None, Fp8SkinnyConfig(**PRODUCER), residual=res.clone(), quant_out=gamma)
    y = fp8_gemm_skinny(handed, w_up, None, Fp8SkinnyConfig(**TINY))
    q, s = quantize_rows(h, gamma, group=32)
    assert torch.equal(y, fp8_gemm_skinny(QuantizedRows(q, s, 32, h.dtype), w_up, None, Fp8SkinnyConfig(**TINY)))


def test_a_quantized_input_needs_per_channel_weights_and_a_group_of_32_or_more():
    x = _x(3, 96)
    q, s = quantize_rows(x, None, group=32)
    with pytest.raises(ValueError, match="per-channel weights"):
        fp8_gemm_skinny(QuantizedRows(q, s, 32, x.dtype), _weight(48, 96, (16, 32), False), None,
                        Fp8SkinnyConfig(**TINY))
    q, s = quantize_rows(x, None, group=16)
    with pytest.raises(ValueError, match="group of 32 or more"):
        fp8_gemm_skinny(QuantizedRows(q, s, 16, x.dtype), _weight(48, 96, None, False), None, Fp8SkinnyConfig(**TINY))


# ----------------------------------------------------------------------------- the model's wiring

def _load(src: str, handoff: bool, monkeypatch, **kw):
    import slipstream.ops.fp8_linear as fl
    from slipstream.model.loader import load_model
    monkeypatch.setattr(fl, "HANDOFF", handoff)  # read when the loader folds the norms
    return load_model(src, quantization="fp8", **kw)[0]


def test_the_model_wires_the_handoff_where_an_fp8_product_feeds_another(tiny_model, monkeypatch):
    """o hands on to gate_up, down to the next layer's qkv (the last layer's down to nobody);
    off by default; on the CPU the products are the reference's, so the logits are the same."""
    from helpers import PagedModelRunner
    src, _ = tiny_model("llama")
    on, off = _load(src, True, monkeypatch), _load(src, False, monkeypatch)
    for i, layer in enumerate(on.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.o_proj.handoff_gamma is mlp.gate_up_proj.gamma is not None
        nxt = on.layers[i + 1].self_attn.qkv_proj.gamma if i + 1 < len(on.layers) else None
        assert mlp.down_proj.handoff_gamma is nxt
        assert attn.qkv_proj.handoff_gamma is None and mlp.gate_up_proj.handoff_gamma is None
    assert on.layers[0].mlp.down_proj.handoff_gamma is not None
    assert all(p.handoff_gamma is None for p in off.modules() if hasattr(p, "handoff_gamma"))
    chunks = [(0, list(range(3, 20))), (1, [7, 8, 9])]
    assert torch.equal(PagedModelRunner(on).step(chunks), PagedModelRunner(off).step(chunks))


def test_block_weights_and_bf16_models_hand_nothing_on(tiny_model, tmp_path, monkeypatch):
    from test_fp8_weights import _write_fp8_checkpoint

    import slipstream.ops.fp8_linear as fl
    from slipstream.model.loader import load_model
    src, _ = tiny_model("llama")
    _write_fp8_checkpoint(src, str(tmp_path), "fp8-block")
    block = _load(str(tmp_path), True, monkeypatch)
    assert block.layers[0].self_attn.o_proj.fp8.block is not None
    assert all(p.handoff_gamma is None for p in block.modules() if hasattr(p, "handoff_gamma"))
    monkeypatch.setattr(fl, "HANDOFF", True)
    plain, _ = load_model(src)
    assert not any(hasattr(p, "handoff_gamma") for p in plain.modules())


def test_the_handing_ops_fall_back_to_the_plain_products_on_the_cpu():
    from slipstream.ops.fp8_linear import fp8_linear_add_, fp8_linear_add_handing_
    w = _weight(48, 96, None, False)
    x, res = _x(5, 96), _x(5, 48, seed=3)
    got = res.clone()
    assert fp8_linear_add_handing_(got, x, w, None, _gamma(48)) is None
    assert torch.equal(got, fp8_linear_add_(res.clone(), x, w))


@pytest.mark.gpu
def test_smollm2_fp8_with_the_handoff_against_bf16(monkeypatch):
    """SmolLM2-135M quantized at load, 12 sequences decoded together (12 rows a step: the
    skinny route, where o and down hand their outputs on quantized per 64 columns) and fed
    bf16's greedy continuations: FP8 with the handoff against bf16 within the bound of
    tests/test_gpu_fp8.py's test (85% greedy agreement, 0.16 nat), and its handoffs counted
    (o_proj's input from the decode kernel among them)."""
    from helpers import PagedModelRunner
    from test_gpu_engine import QUESTIONS

    import slipstream.model.fp8_layers as layers
    import slipstream.ops.fp8_linear as fl
    from slipstream import LLM, SamplingParams
    from slipstream.model.loader import load_model
    from slipstream.model.tokenizer import load_tokenizer
    tok = load_tokenizer(None)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS[:12]]
    with LLM(device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=16) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    conts = [o.token_ids for o in outs]
    handed, from_attention = [], []
    real = layers.fp8_linear_add_handing_

    def counting(out, x, *args, **kw):
        q = real(out, x, *args, **kw)
        handed.append(q is not None)
        from_attention.append(isinstance(x, QuantizedRows))  # o_proj's input quantized by the decode kernel
        return q
    monkeypatch.setattr(layers, "fp8_linear_add_handing_", counting)
    logps = {}
    for name, quant, handoff in (("bf16", None, False), ("fp8", "fp8", False), ("handoff", "fp8", True)):
        monkeypatch.setattr(fl, "HANDOFF", handoff)
        model, _ = load_model(None, dtype="bfloat16", device="cuda", quantization=quant)
        runner = PagedModelRunner(model, num_blocks=1024, block_size=16)
        last = [runner.step([(i, p)])[-1] for i, p in enumerate(prompts)]  # each prompt's prefill alone
        steps = [torch.stack(last)]
        for t in range(len(conts[0]) - 1):
            steps.append(runner.step([(i, [c[t]]) for i, c in enumerate(conts)]))
        logps[name] = torch.log_softmax(torch.stack(steps).float(), -1)  # [steps, 12, vocab]
        del model, runner
    target = torch.tensor(conts, device="cuda").T  # [steps, 12]: bf16's next tokens
    results = {}
    for name in ("fp8", "handoff"):
        agree = (logps[name].argmax(-1) == logps["bf16"].argmax(-1)).float().mean().item()
        pick = lambda lp: lp.gather(-1, target[..., None])[..., 0]  # noqa: E731
        diff = (pick(logps[name]) - pick(logps["bf16"])).abs().mean().item()
        results[name] = (agree, diff)
    print(f"\nSmolLM2-135M decode rows against bf16 (agreement, mean |d logprob|): {results}; "
          f"products that handed on: {sum(handed)} of {len(handed)}, o_proj inputs quantized by "
          f"attention: {sum(from_attention)}")
    assert sum(handed) > 0 and sum(from_attention) > 0
    for agree, diff in results.values():
        assert agree >= 0.85 and diff <= 0.16, results
