"""FP8 weights on the CPU (docs/fp8.md): the e4m3 arithmetic, the three checkpoint formats
written tiny and loaded back, `--quantization fp8` at load, the logits against the
unquantized model within a bound from e4m3's precision, and tensor parallelism.

e4m3 keeps 3 mantissa bits, so rounding moves a normal value by at most half a step:
|q * s - w| <= 2^-4 |w|; below the smallest normal (2^-6 * s) the step is fixed at 2^-9 * s,
so the error is at most 2^-10 * s there. `_assert_within_e4m3` checks exactly that.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from slipstream.config import QUANTIZATIONS as CONFIG_QUANTIZATIONS
from slipstream.config import EngineConfig
from slipstream.model.loader import load_model
from slipstream.quant import QUANTIZATIONS, scheme_from_config
from slipstream.quant.fp8 import (FP8_DTYPE, REL_ERR, dequantize, expand_scale, quantize_blocks,
                                  quantize_per_channel, quantize_per_tensor, quantize_per_token)

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the tiny models' sizes (tests/helpers.py) split into 16x16 blocks on one or two ranks
BLOCK = (16, 16)


def _assert_within_e4m3(deq: torch.Tensor, w: torch.Tensor, scale_full: torch.Tensor):
    bound = REL_ERR * w.abs() + 2.0 ** -10 * scale_full + 1e-12
    assert ((deq - w).abs() <= bound).all(), float(((deq - w).abs() - bound).max())


@pytest.mark.parametrize("how", ["tensor", "channel", "block"])
def test_quantize_then_dequantize_is_within_half_an_e4m3_step(how):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g) * torch.logspace(-3, 1, 72)  # columns of many magnitudes
    w[3] = 0.0  # an all-zero row divides by the floor scale, not by zero
    if how == "tensor":
        q, s = quantize_per_tensor(w)
        assert s.shape == (40,) and (s == s[0]).all()
    elif how == "channel":
        q, s = quantize_per_channel(w)
        assert s.shape == (40,)
    else:
        q, s = quantize_blocks(w, BLOCK)  # 40 x 72: edge blocks of 8 rows and 8 columns
        assert s.shape == (3, 5)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    block = BLOCK if how == "block" else None
    deq = dequantize(q, s, block)
    _assert_within_e4m3(deq, w, expand_scale(s, tuple(w.shape), block))
    assert (deq[3] == 0).all() and torch.isfinite(deq).all()
    assert (deq - w).abs().max() > 0  # it did round


def test_per_token_activation_scales_are_each_rows_own():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g)
    x[2] *= 1000.0  # one loud row does not change the others' scales
    q, s = quantize_per_token(x)
    q1, s1 = quantize_per_token(x[:1])
    assert s.shape == (4, 1) and torch.equal(s[:1], s1) and torch.equal(q[:1].float(), q1.float())
    qg, sg = quantize_per_token(x, group=16)
    assert sg.shape == (4, 4)
    _assert_within_e4m3(qg.float() * sg.repeat_interleave(16, 1), x, sg.repeat_interleave(16, 1))


def test_the_engine_option_and_the_package_agree():
    assert CONFIG_QUANTIZATIONS == QUANTIZATIONS
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "awq"}, "unsupported quantization_config.quant_method 'awq'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "is not FP8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "only 8-bit float"),
    ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["model.layers.0.mlp"]}, "not supported"),
])
def test_unsupported_quantization_configs_are_one_line_errors(qc, match):
    with pytest.raises(ValueError, match=match):
        scheme_from_config(qc)


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _write_fp8_checkpoint(src: str, dst: str, fmt: str) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint in `src` whose decoder projections are FP8 in format `fmt`, as
    that format's producers write them; returns the original (fp32) projection weights."""
    from safetensors.torch import save_file
    tensors, originals = _tensors(src), {}
    for name in list(tensors):
        if not (name.endswith(".weight") and any(f".{p}." in name for p in PROJS)):
            continue
        w = originals[name] = tensors[name]
        prefix = name.removesuffix(".weight")
        if fmt in ("ct-channel", "fbgemm"):
            q, s = quantize_per_channel(w)
            tensors[f"{prefix}.weight_scale"] = s[:, None].contiguous()  # [N, 1]
        elif fmt in ("ct-tensor", "fp8-tensor"):
            q, s = quantize_per_tensor(w)
            tensors[f"{prefix}.weight_scale"] = s[:1].clone() if fmt == "ct-tensor" else s[0].clone()
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.5)  # static activation scale: unused
        else:
            q, s = quantize_blocks(w, BLOCK)
            tensors[f"{prefix}.weight_scale_inv"] = s
        tensors[name] = q
    qc = {
        "ct-channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                       "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                           "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                           "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                 "dynamic": True}}}},
        "ct-tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                          "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}}}},
        "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
        "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
        "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": list(BLOCK)},
    }[fmt]
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": qc}, f)
    return originals


FORMATS = ["ct-channel", "ct-tensor", "fbgemm", "fp8-tensor", "fp8-block"]


def _layer_weights(model, i: int):
    """(hf projection name -> (dequantized fp32 weight, each weight's scale)) of layer i."""
    layer = model.layers[i]
    a, inter = layer.self_attn, model.config.intermediate_size
    out = {}
    for proj, parts in ((a.qkv_proj, [("self_attn.q_proj", a.q_size), ("self_attn.k_proj", a.kv_size),
                                      ("self_attn.v_proj", a.kv_size)]),
                        (a.o_proj, [("self_attn.o_proj", None)]),
                        (layer.mlp.gate_up_proj, [("mlp.gate_proj", inter), ("mlp.up_proj", inter)]),
                        (layer.mlp.down_proj, [("mlp.down_proj", None)])):
        deq = proj.fp8.dequantized(torch.float32)
        scale = expand_scale(proj.weight_scale, tuple(proj.weight.shape), proj.fp8.block)
        row = 0
        for name, rows in parts:
            rows = rows or deq.shape[0]
            out[f"model.layers.{i}.{name}.weight"] = (deq[row:row + rows], scale[row:row + rows])
            row += rows
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_fp8_checkpoint_format_loads_back_its_weights(tiny_model, tmp_path, fmt):
    src, _ = tiny_model("llama")
    originals = _write_fp8_checkpoint(src, str(tmp_path / fmt), fmt)
    model, cfg = load_model(str(tmp_path / fmt))
    want = {"ct-channel": "channel", "ct-tensor": "tensor", "fbgemm": "channel", "fp8-tensor": "tensor",
            "fp8-block": "block"}[fmt]
    assert cfg.quantization.serialized and cfg.quantization.granularity == want
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert model.lm_head.weight.dtype == model.embed_tokens.weight.dtype == torch.float32  # stay unquantized
    checked = 0
    for i in range(cfg.num_layers):
        for name, (deq, scale) in _layer_weights(model, i).items():
            _assert_within_e4m3(deq, originals[name], scale)
            checked += 1
    assert checked == len(originals)
    # the norms are folded as gamma beside the FP8 values (not multiplied into them)
    norm = _tensors(src)["model.layers.0.input_layernorm.weight"]
    assert torch.equal(model.layers[0].self_attn.qkv_proj.gamma, norm.float())


def test_kv_cache_scales_beside_the_weights_are_not_weights(tiny_model, tmp_path):
    """An FP8 checkpoint with a KV cache scheme carries per-layer k/v scales (read by
    model/kv_scales.py, not by the weight loader)."""
    from safetensors.torch import load_file, save_file
    src, _ = tiny_model("llama")
    dst = str(tmp_path / "kv")
    _write_fp8_checkpoint(src, dst, "ct-channel")
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor(0.5)
    save_file(tensors, path)
    model, _ = load_model(dst)
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE


def test_a_missing_scale_or_a_wrong_dtype_names_the_tensor(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file
    src, _ = tiny_model("llama")
    dst = str(tmp_path / "ckpt")
    _write_fp8_checkpoint(src, dst, "fp8-block")
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    scale = tensors.pop("model.layers.1.mlp.down_proj.weight_scale_inv")
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing tensors \[model.layers.1.mlp.down_proj.weight_scale_inv\]"):
        load_model(dst)
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = scale[:, :1].contiguous()
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv' has shape \(4, 1\), expected \(4, 8\)"):
        load_model(dst)
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = scale
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].float()
    save_file(tensors, path)
    with pytest.raises(ValueError, match="down_proj.weight' is torch.float32, expected float8_e4m3fn"):
        load_model(dst)


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_per_channel(tiny_model):
    src, _ = tiny_model("llama")
    model, cfg = load_model(src, quantization="fp8")
    assert cfg.quantization.granularity == "channel" and not cfg.quantization.serialized
    originals = _tensors(src)
    for i in range(cfg.num_layers):
        for name, (deq, scale) in _layer_weights(model, i).items():
            _assert_within_e4m3(deq, originals[name], scale)
            # one scale a row: the row's largest weight lands on e4m3's largest value, 448
            torch.testing.assert_close(scale[:, 0], originals[name].abs().amax(1) / 448.0)
    plain, plain_cfg = load_model(src, quantization="none")
    assert plain_cfg.quantization is None and plain.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32


def test_fp8_logits_stay_within_the_bound_of_e4m3_rounding(tiny_model):
    """Bound: every weight of the 4 products a layer (qkv, o, gate_up, down) moves by at most
    2^-4 of itself (half an e4m3 step), so each product's output moves by at most 2^-4 of
    sum |w||x|; with the rounding errors of different products independent, their effects on
    the logits add in quadrature: relative RMS error <= 2^-4 * sqrt(4 * layers) (0.18 for
    the 2-layer model, which measures ~0.1). The CPU path quantizes weights only."""
    from helpers import PagedModelRunner
    src, _ = tiny_model("llama")
    ref, cfg = load_model(src)
    fp8, _ = load_model(src, quantization="fp8")
    chunks = [(0, list(range(3, 40))), (1, [7, 8, 9, 10])]
    a = PagedModelRunner(ref).step(chunks)
    b = PagedModelRunner(fp8).step(chunks)
    rel = float((b - a).norm() / a.norm())
    bound = REL_ERR * (4 * cfg.num_layers) ** 0.5
    assert 1e-4 < rel <= bound, (rel, bound)


def test_dummy_weights_with_fp8_are_the_unquantized_dummy_weights_quantized(tiny_model):
    src, _ = tiny_model("qwen3")
    plain, _ = load_model(src, "dummy")
    fp8, cfg = load_model(src, "dummy", quantization="fp8")
    assert not cfg.quantization.serialized
    w = plain.layers[1].mlp.down_proj.weight
    q, s = quantize_per_channel(w)
    assert torch.equal(fp8.layers[1].mlp.down_proj.weight.float(), q.float())
    assert torch.equal(fp8.layers[1].mlp.down_proj.weight_scale, s)


def test_fp8_is_refused_for_moe_and_gemma3(tmp_path):
    config = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
              "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="dense Llama-family decoders"):
        load_model(str(path), "dummy", quantization="fp8")


@pytest.mark.parametrize("fmt", ["quantize-at-load", "ct-channel", "fp8-tensor", "fp8-block"])
def test_each_rank_holds_its_slice_of_the_fp8_weights_and_scales(tiny_model, tmp_path, fmt):
    """Column-parallel layers keep their rows' scales, row-parallel ones all of them (per
    channel) or their blocks' columns; quantized at load, a rank's values and scales are
    the one-rank model's, computed over whole rows."""
    from slipstream.model.parallel import TPGroup, TPShard
    src, _ = tiny_model("llama")
    quantization = None
    if fmt == "quantize-at-load":
        folder, quantization = src, "fp8"
    else:
        folder = str(tmp_path / fmt)
        _write_fp8_checkpoint(src, folder, fmt)
    whole, cfg = load_model(folder, quantization=quantization)
    d, a = cfg.head_dim, whole.layers[0].self_attn
    for rank in range(2):
        s = TPShard(rank, 2, cfg)
        part, _ = load_model(folder, quantization=quantization, tp=TPGroup(s, None))
        heads = slice(rank * s.num_heads * d, (rank + 1) * s.num_heads * d)
        kv = slice(s.kv_head_start * d, (s.kv_head_start + s.num_kv_heads) * d)
        i = s.intermediate_size
        cols = slice(rank * i, (rank + 1) * i)
        for w, p in zip(whole.layers, part.layers):
            for wl, pl, rows, col_slice in (
                    (w.self_attn.qkv_proj, p.self_attn.qkv_proj,
                     [slice(0, a.q_size), slice(a.q_size, a.q_size + a.kv_size), slice(a.q_size + a.kv_size, None)],
                     None),
                    (w.self_attn.o_proj, p.self_attn.o_proj, None, heads),
                    (w.mlp.gate_up_proj, p.mlp.gate_up_proj, [slice(0, cfg.intermediate_size),
                                                              slice(cfg.intermediate_size, None)], None),
                    (w.mlp.down_proj, p.mlp.down_proj, None, cols)):
                deq_whole = wl.fp8.dequantized(torch.float32)
                if rows is not None:  # column-parallel: this rank's rows of each part
                    pieces = [deq_whole[r] for r in rows]
                    sel = [heads, kv, kv] if len(rows) == 3 else [cols, cols]
                    want = torch.cat([piece[x] for piece, x in zip(pieces, sel)])
                else:  # row-parallel: this rank's columns
                    want = deq_whole[:, col_slice]
                assert torch.equal(pl.fp8.dequantized(torch.float32), want), (fmt, rank)


@pytest.mark.subprocess
def test_two_ranks_give_the_tokens_of_one_with_fp8_weights(tiny_model, tmp_path):
    from slipstream import LLM, SamplingParams
    src, _ = tiny_model("llama")
    folder = str(tmp_path / "block")
    _write_fp8_checkpoint(src, folder, "fp8-block")
    prompts = [[5, 6, 7, 8], list(range(20, 60))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outs = {}
    for tp in (1, 2):
        with LLM(folder, device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=tp) as llm:
            outs[tp] = llm.generate(prompts, [params] * 2)
    assert [o.token_ids for o in outs[2]] == [o.token_ids for o in outs[1]]
    for a, b in zip(outs[1][1].logprobs, outs[2][1].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_llm_generates_with_quantization_fp8(tiny_model):
    from slipstream import LLM, SamplingParams
    src, _ = tiny_model("llama")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(src, device="cpu", dtype="float32", max_model_len=64, quantization="fp8") as llm:
        out = llm.generate([[5, 6, 7, 8]], params)[0]
        assert llm.engine.model.config.quantization.granularity == "channel"
    assert len(out.token_ids) == 6


def test_the_checkpoints_scheme_wins_over_the_flag(tiny_model, tmp_path):
    src, _ = tiny_model("llama")
    folder = str(tmp_path / "ct")
    _write_fp8_checkpoint(src, folder, "ct-channel")
    _, cfg = load_model(folder, quantization="fp8")
    assert cfg.quantization.method == "compressed-tensors" and cfg.quantization.serialized


def test_fp8_workloads_are_their_parents_with_fp8_weights():
    from slipstream.bench.workloads import get_workload
    for name, parent, n in (("seed-8b-fp8", "seed-8b", None), ("seed-8b-short-fp8", "seed-8b-short", None),
                            ("seed-8b-bs1-fp8", "seed-8b-short", 1), ("seed-8b-bs8-fp8", "seed-8b-short", 8)):
        w, p = get_workload(name), get_workload(parent)
        kv = {"kv_cache_dtype": "fp8"} if name == "seed-8b-short-fp8" else {}  # FP8 weights and KV cache
        assert w.name == name and w.engine == {**p.engine, "quantization": "fp8", **kv}
        assert w.prompts == p.prompts[:n] and w.params == p.params[:n] and w.latency == (n is not None)


def test_the_floor_counts_fp8_weights_and_their_scales(tmp_path):
    """The 8B shape's floor reads each projection weight as one byte, plus a float32 scale an
    output row and the two folded norms' float32 gammas a layer; the LM head stays bf16."""
    from slipstream.bench.throughput import StepCosts
    from slipstream.bench.workloads import get_workload
    from slipstream.model.loader import load_config
    from slipstream.quant import QUANTIZE_AT_LOAD
    c = load_config(get_workload("seed-8b-fp8").model)
    bf16 = StepCosts.of(c, torch.bfloat16)
    fp8 = StepCosts.of(dataclasses.replace(c, quantization=QUANTIZE_AT_LOAD), torch.bfloat16)
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size
    rows = (q + 2 * kv) + h + 2 * i + h  # output rows of qkv, o, gate_up, down
    head = c.vocab_size * h * 2
    assert fp8.weight_bytes == bf16.matmul_params + c.num_layers * 4 * (rows + 2 * h) + head
    assert bf16.weight_bytes == 2 * bf16.matmul_params + head
    assert 0.53 < fp8.weight_bytes / bf16.weight_bytes < 0.54  # 8.04 GB against 15.01 GB
    assert fp8.matmul_params == bf16.matmul_params and fp8.kv_bytes_per_token == bf16.kv_bytes_per_token


@pytest.mark.slow
def test_a_gguf_model_is_quantized_at_load():
    """The embedded SmolLM2 (GGUF Q4_1): its dequantized tensors quantized per channel."""
    from helpers import smollm2
    ref, _, _ = smollm2()
    fp8, cfg = load_model(None, quantization="fp8")
    assert cfg.quantization.granularity == "channel"
    for a, b in ((ref.layers[0].mlp.down_proj, fp8.layers[0].mlp.down_proj),
                 (ref.layers[-1].self_attn.o_proj, fp8.layers[-1].self_attn.o_proj)):
        w = a.weight  # o and down have no folded norm: the checkpoint's values
        _assert_within_e4m3(b.fp8.dequantized(torch.float32), w, expand_scale(b.weight_scale, tuple(w.shape), None))


def test_load_config_gives_the_scheme_load_model_builds(tiny_model):
    """(A tensor-parallel engine reads the config without the weights: its bench floor and
    checks see the FP8 scheme the ranks load.)"""
    from slipstream.model.loader import load_config
    src, _ = tiny_model("llama")
    assert load_config(src).quantization is None
    assert load_config(src, "fp8") == load_model(src, quantization="fp8")[1]
