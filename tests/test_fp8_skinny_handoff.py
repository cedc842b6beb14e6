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
from slipstream.ops.triton_fp8_quant import QuantizedRows, quantize_rows

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
