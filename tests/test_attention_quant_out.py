"""The decode kernel writing its output as the FP8 o projection's input (`quant_out`,
ops/triton_attention.py): e4m3 codes and one scale a row per 64 columns, the bits of
`quantize_rows` on the bf16 output the same launch writes without it, for every way the
kernel stores a row (one split, the in-kernel merge, the reduce pass, the epilogue inside,
padding rows and tokens past the batch); and the layer handing it to o_proj.

On the CPU under Triton's interpreter at tiny sizes (tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch
from test_attention_kernels import (DECODE_SEQS, SMALL_DECODE, attention_with_epilogue_inside, epilogue_case,
                                    make_batch)

from slipstream.ops.triton_attention import paged_attention_triton
from slipstream.ops.triton_fp8_quant import quantize_rows
from slipstream.quant.fp8 import FP8_DTYPE, MIN_SCALE, QuantizedRows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _buffers(tokens: int, width: int, group: int) -> QuantizedRows:
    """Buffers holding garbage (NaN scales): whatever the kernel leaves unwritten shows."""
    return QuantizedRows(torch.full((tokens, width), 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE),
                         torch.full((tokens, width // group), float("nan"), device=DEVICE), group, torch.bfloat16)


def _assert_codes_of(quant: QuantizedRows, out: torch.Tensor) -> None:
    q, s = quantize_rows(out.reshape(out.shape[0], -1), None, group=quant.group)
    assert torch.equal(quant.scale, s)
    assert torch.equal(quant.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4)])
@pytest.mark.parametrize("splits,order,counters", [
    (1, True, True),  # one split: the direct store
    (3, True, True),  # the last split merges in the kernel
    pytest.param(3, False, False, marks=pytest.mark.slow),  # the reduce pass merges
])
def test_decode_output_quantized_in_the_kernel(head_dim, group, splits, order, counters):
    """Two KV heads; an empty row (zeros: scale MIN_SCALE) and two tokens past the batch."""
    seqs = [(9, 1), (0, 1), (40, 1), (17, 1)]
    q, kc, vc, meta = make_batch(seqs, 2, group, head_dim, 16, torch.bfloat16, seed=4, extra_tokens=2,
                                 order=order, counters=counters)
    scale = head_dim ** -0.5
    out = paged_attention_triton(q, kc, vc, meta, scale, decode_config=SMALL_DECODE, num_splits=splits)
    quant = _buffers(q.shape[0], q.shape[1] * head_dim, 64)
    untouched = torch.full_like(q, 3.0)
    paged_attention_triton(q, kc, vc, meta, scale, out=untouched, decode_config=SMALL_DECODE,
                           num_splits=splits, quant_out=quant)
    _assert_codes_of(quant, out)
    assert (untouched == 3.0).all()  # the bf16 output is not written
    assert (quant.scale[1] == MIN_SCALE).all() and (quant.scale[-2:] == MIN_SCALE).all()


def test_decode_with_the_epilogue_inside_quantizes_too():
    qkv, epi, kc, vc, meta = epilogue_case([5, 30, 12], 2, 4, 128, 16, torch.bfloat16, seed=8, norms=True)
    kc2, vc2 = kc.clone(), vc.clone()
    out = attention_with_epilogue_inside(qkv.clone(), epi, kc, vc, meta, 8, decode_config=SMALL_DECODE)
    quant = _buffers(3, 8 * 128, 64)
    attention_with_epilogue_inside(qkv.clone(), epi, kc2, vc2, meta, 8, decode_config=SMALL_DECODE,
                                   quant_out=quant)
    _assert_codes_of(quant, out)
    assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0))  # the same K/V stored


def test_quantized_output_only_for_a_batch_the_decode_kernel_runs_alone():
    seqs = [(9, 3), (12, 1)]  # a prefill chunk: the prefill kernel's rows
    q, kc, vc, meta = make_batch(seqs, 2, 2, 64, 16, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="decode kernel only"):
        paged_attention_triton(q, kc, vc, meta, 0.1, quant_out=_buffers(q.shape[0], 4 * 64, 64))
    q, kc, vc, meta = make_batch(DECODE_SEQS, 2, 2, 32, 16, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="multiple of its 64-column groups"):
        paged_attention_triton(q, kc, vc, meta, 0.1, decode_config=SMALL_DECODE,
                               quant_out=_buffers(q.shape[0], 4 * 32, 64))


def test_the_cpu_dispatch_refuses_a_quantized_output():
    from slipstream.ops.attention import paged_attention
    q, kc, vc, meta = make_batch(DECODE_SEQS, 2, 2, 64, 16, torch.bfloat16, seed=2, device="cpu")
    rows = QuantizedRows.empty(q.shape[0], 4 * 64, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="CUDA decode kernel only"):
        paged_attention(q.cpu(), kc.cpu(), vc.cpu(), meta, 0.1, quant_out=rows)


def test_the_layer_asks_for_a_quantized_output_only_where_o_proj_hands_off(tiny_model, monkeypatch):
    """On the CPU nothing hands off (the products are the reference's): every o_proj of an
    FP8 model wired for the handoff takes its input unquantized there, and a bf16 one never
    takes it quantized."""
    from test_fp8_skinny_handoff import _load

    from slipstream.model.loader import load_model
    src, _ = tiny_model("llama")
    on = _load(src, True, monkeypatch)
    h = torch.zeros(24, on.config.hidden_size)
    for layer in on.layers:
        assert layer.self_attn.o_proj.takes_quantized
        assert layer.self_attn.o_proj.input_quant_group(h) == 0
    plain, _ = load_model(src)
    assert plain.layers[0].self_attn.o_proj.input_quant_group(h) == 0


def test_o_proj_takes_the_quantized_rows_as_they_are():
    """`fp8_linear_add_handing_` / `fp8_linear_add_` given a `QuantizedRows` (the decode
    kernel's output): the skinny GEMM multiplies its codes with their 64-column scales into
    the residual (against the dequantized rows' product), and hands its own output on."""
    import torch.nn.functional as F
    from helpers import rel_rms
    from test_fp8_kernels import _weight

    from slipstream.ops.fp8_linear import HANDOFF_GROUP, fp8_linear_add_, fp8_linear_add_handing_
    w = _weight(64, 128, None, False)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 128, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(5, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    q, s = quantize_rows(x, None, group=HANDOFF_GROUP)
    rows = QuantizedRows(q, s, HANDOFF_GROUP, torch.bfloat16)
    want = F.linear(q.float() * s.repeat_interleave(HANDOFF_GROUP, 1), w.dequantized(torch.float32)) + res.float()
    plain = fp8_linear_add_(res.clone(), rows, w)
    assert rel_rms(plain.float(), want) < 2 ** -7
    gamma = torch.rand(64, generator=g).to(DEVICE) + 0.5
    h = res.clone()
    handed = fp8_linear_add_handing_(h, rows, w, None, gamma)
    assert torch.equal(h, plain)
    hq, hs = quantize_rows(h, gamma, group=handed.group)
    assert torch.equal(handed.scale, hs) and torch.equal(handed.q.view(torch.uint8), hq.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize("rows,splits", [(32, None), (8, 16), (1, None)])
def test_gpu_8b_decode_output_quantized(rows, splits, fp8_cache):
    """The 8B shape at the engine's sizes (seed-8b-short-fp8's 32 rows with the default split
    choice; 8 rows split 16 ways, merged in the kernel; one row), bf16 or FP8 cache, two
    tokens past the batch: the same bits as `quantize_rows` on the bf16 output."""
    from slipstream.ops.kv_quant import FP8_DTYPE as KV_FP8, KVScales
    g = torch.Generator().manual_seed(rows)
    seqs = [(int(n), 1) for n in torch.randint(1, 3000, (rows,), generator=g)]
    q, kc, vc, meta = make_batch(seqs, 8, 4, 128, 16, torch.bfloat16, seed=rows, extra_tokens=2)
    kw = dict(num_splits=splits)
    if fp8_cache:
        kc, vc = kc.nan_to_num(0.0).to(KV_FP8), vc.nan_to_num(0.0).to(KV_FP8)
        kw["kv_scales"] = KVScales(0.5, 0.25)
    out = paged_attention_triton(q, kc, vc, meta, 0.088, **kw)
    quant = _buffers(q.shape[0], 32 * 128, 64)
    paged_attention_triton(q, kc, vc, meta, 0.088, quant_out=quant, **kw)
    _assert_codes_of(quant, out)
    assert (quant.scale[-2:] == MIN_SCALE).all()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,finished", [(128, True), (128, False), (32, True)])
def test_gpu_layer_attention_quantized_where_a_head_is_whole_groups(head_dim, finished):
    """`attention_after_qkv(quant_group=64)` on a decode batch: quantized rows with the bits of
    the plain call's output, whether the epilogue runs inside the decode kernel (qkv finished)
    or before it (the row scale left to apply); a head narrower than a group (32) and a batch
    with a prompt chunk come back unquantized."""
    from dataclasses import replace

    from slipstream.ops.attention import attention_after_qkv
    qkv, epi, kc, vc, meta = epilogue_case([5, 30, 12], 2, 4, head_dim, 16, torch.bfloat16, seed=9, norms=True)
    if not finished:  # the folded norm's row scale still to apply: the epilogue kernel's path
        epi = replace(epi, hidden=torch.randn(3, 256, device=DEVICE).to(torch.bfloat16))

    def attend(m, **kw):
        return attention_after_qkv(qkv.clone(), epi, kc.clone(), vc.clone(), m, head_dim ** -0.5, 8, 2, head_dim, **kw)

    plain, got = attend(meta), attend(meta, quant_group=64)
    if head_dim % 64:
        assert isinstance(got, torch.Tensor) and torch.equal(got, plain)
        return
    assert isinstance(got, QuantizedRows) and got.group == 64
    _assert_codes_of(got, plain)
    assert isinstance(attend(replace(meta, max_query_len=2), quant_group=64), torch.Tensor)
