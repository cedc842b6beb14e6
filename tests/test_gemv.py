"""The small-batch GEMV (slipstream.ops.triton_gemv) against F.linear: bias, the residual
added in place, strided inputs, every padded row count; and when the linear layers take it.

On CPU the kernel runs under Triton's interpreter (tests/conftest.py) at tiny sizes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.ops.triton_gemv import GemvConfig, choose_block_n, gemv, gemv_applies, stream_columns, streams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = GemvConfig(tile_elems=2048)  # K = 200 (padded to 256): 1-8 columns a program


def _data(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (w, x, b, r)]


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 1, 8])
def test_values_match_f_linear(dtype, m):
    w, x, b, r = _data(m, 37, 200, dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    y = gemv(x, w, b, cfg=TINY)
    assert y.dtype == dtype and y.shape == (m, 37)
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(gemv(x, w, cfg=TINY).float(), ref - b.float(), atol=tol, rtol=tol)


def test_residual_is_added_in_place_and_rounded_once():
    w, x, b, r = _data(5, 48, 96, torch.float32)
    expect = r + F.linear(x, w, b)
    out = gemv(x, w, b, residual=r, out=r, cfg=TINY)
    assert out.data_ptr() == r.data_ptr()
    torch.testing.assert_close(r, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_scale_is_a_folded_norms_statistic_then_the_bias(dtype):
    from slipstream.ops.fused import scale_rows_ref
    w, x, b, _ = _data(3, 40, 96, dtype)
    x = x * 7.0  # far from unit RMS: a missing scale cannot pass
    expect = scale_rows_ref(F.linear(x.float(), w.float()), x.float(), 1e-5, b.float())
    y = gemv(x, w, b, row_scale_eps=1e-5, cfg=TINY)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), expect, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_input_into_the_residual(dtype):
    from slipstream.ops.fused import silu_and_mul_ref
    w, _, _, r = _data(2, 24, 80, dtype, seed=1)
    gate_up = torch.randn(2, 160, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    act = silu_and_mul_ref(gate_up)  # rounded to dtype, as the GEMV rounds its input
    expect = r.float() + F.linear(act.float(), w.float())
    out = gemv(gate_up, w, residual=r, out=r, silu_mul=True, cfg=TINY)
    assert out.data_ptr() == r.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(r.float(), expect, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="input width 80"):
        gemv(gate_up[:, :80], w, silu_mul=True, cfg=TINY)


def test_strided_and_leading_dims():
    w, x, _, _ = _data(6, 40, 64, torch.float32)
    wide = torch.randn(6, 128, device=DEVICE)
    wide[:, 10:74] = x
    torch.testing.assert_close(gemv(wide[:, 10:74], w, cfg=TINY), F.linear(x, w), atol=1e-5, rtol=1e-5)
    y3 = gemv(x.view(2, 3, 64), w, cfg=TINY)
    assert y3.shape == (2, 3, 40)
    torch.testing.assert_close(y3.view(6, 40), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_block_n_keeps_every_sm_busy():
    # (N, SMs) -> columns a program: programs_per_sm x SMs programs when N allows, 2..32
    assert choose_block_n(1024, 132) == 2  # o / down of the 0.6B shape: 512 programs
    assert choose_block_n(6144, 132) == 8  # gate_up: 768 programs
    assert choose_block_n(4096, 132) == 4  # qkv
    assert choose_block_n(1 << 20, 132) == 32
    assert choose_block_n(8, 132) == 2
    assert choose_block_n(1024, 132, GemvConfig(block_n=8)) == 8


def test_which_products_take_the_gemv():
    w = torch.empty(1024, 1024, dtype=torch.bfloat16)
    assert gemv_applies(torch.empty(1, 1024), w) and gemv_applies(torch.empty(1, 1, 1024), w)
    assert not gemv_applies(torch.empty(2, 1024), w)  # cuBLAS from 2 rows (the measured crossover)
    assert gemv_applies(torch.empty(8, 1024), w, GemvConfig(max_rows=8))
    assert not gemv_applies(torch.empty(0, 1024), w)
    o_8b = torch.empty(4096, 4096, dtype=torch.bfloat16)  # 32 MiB: the streaming kernel
    assert gemv_applies(torch.empty(1, 4096), o_8b) and not gemv_applies(torch.empty(2, 4096), o_8b)
    assert not gemv_applies(torch.empty(1, 4096), o_8b, GemvConfig(max_weight_bytes=16 << 20))
    assert not gemv_applies(torch.empty(1, 32768), torch.empty(16, 32768))  # K past the tile kernel's max_k
    assert gemv_applies(torch.empty(1, 32768), torch.empty(512, 32768, dtype=torch.bfloat16))  # streamed: any K
    # the streaming kernel from 16 MiB: Qwen3-30B-A3B's o_proj (2048 x 4096) streams, 12 MiB does not
    assert streams(1, 16 << 20) and not streams(1, 12 << 20) and not streams(2, 64 << 20)
    # the 8B shape on 132 SMs: o and down (256 programs of 16) fit at once, qkv, gate_up and the
    # lm_head take 8 columns; below stream_wide_bytes 4
    mib = 1 << 20
    assert [stream_columns(n, n * k * 2, 132) for n, k in [(4096, 4096), (4096, 14336), (6144, 4096),
                                                           (28672, 4096), (128256, 4096)]] == [16, 16, 8, 8, 8]
    assert stream_columns(4096, 12 * mib, 132) == 4 and stream_columns(6144, 48 * mib, 192) == 16
    assert stream_columns(6144, 48 * mib, 132, GemvConfig(stream_wide_programs_per_sm=3)) == 16
    assert stream_columns(6144, 48 * mib, 132, GemvConfig(stream_block_n=32)) == 32
    assert not gemv_applies(torch.empty(1, 64), torch.empty(64, 128).t())  # weight not row-major


@pytest.mark.gpu
def test_linear_layers_take_the_gemv_on_cuda_and_match_cublas():
    from slipstream.ops.linear import linear, linear_add_, linear_into_
    w, x, b, r = _data(1, 1024, 2048, torch.bfloat16)
    y = linear(x, w, b)
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), atol=2e-2, rtol=2e-2)
    h = r.clone()
    linear_add_(h, x, w)
    torch.testing.assert_close(h.float(), r.float() + F.linear(x.float(), w.float()), atol=3e-2, rtol=2e-2)
    out = torch.full_like(r, float("nan"))
    linear_into_(out, x, w)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_fused_norm_and_silu_paths_match_the_unfused_ones_on_cuda():
    """At one row `norm_linear` finishes the product itself and `silu_mul_linear_add_` is one
    GEMV; from two rows both fall back to cuBLAS and the separate kernels. Both agree with the
    references, so the engine's batch-1 and batch-N steps compute the same layer."""
    from slipstream.ops.fused import scale_rows_ref, silu_and_mul_ref
    from slipstream.ops.linear import norm_linear, silu_mul_linear_add_
    w, h, b, _ = _data(2, 3072, 1024, torch.bfloat16)
    h = h * 5.0
    for rows in (1, 2):
        y, finished = norm_linear(h[:rows], w, b, 1e-6)
        assert finished == (rows == 1)
        if not finished:
            y = scale_rows_ref(y, h[:rows], 1e-6, b)
        expect = scale_rows_ref(F.linear(h[:rows].float(), w.float()), h[:rows].float(), 1e-6, b.float())
        torch.testing.assert_close(y.float(), expect, atol=3e-2, rtol=2e-2)
    wd, _, _, r = _data(2, 1024, 1536, torch.bfloat16, seed=3)
    gate_up = y[:, :3072].contiguous()
    for rows in (1, 2):
        out = r[:rows].clone()
        silu_mul_linear_add_(out, gate_up[:rows], wd)
        expect = r[:rows].float() + F.linear(silu_and_mul_ref(gate_up[:rows]).float(), wd.float())
        torch.testing.assert_close(out.float(), expect, atol=5e-2, rtol=2e-2)


STREAM = GemvConfig(stream_weight_bytes=0, stream_block_n=4, stream_block_k=32, stream_stages=2)
# the default's shapes: 8 and 16 columns a program, 4 stages
STREAM_WIDE = [STREAM, GemvConfig(stream_weight_bytes=0, stream_block_n=8, stream_block_k=32),
               GemvConfig(stream_weight_bytes=0, stream_block_n=16, stream_block_k=64)]


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("cfg", STREAM_WIDE, ids=["4x2", "8x4", "16x4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_kernel_every_form_at_one_row(dtype, cfg):
    # K = 200 in 32-wide chunks: six full chunks and a masked tail; N = 37, a ragged last block
    from slipstream.ops.fused import scale_rows_ref, silu_and_mul_ref
    w, x, b, r = _data(1, 37, 200, dtype, seed=3)
    x = x * 7.0
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(gemv(x, w, b, cfg=cfg).float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(gemv(x, w, b, row_scale_eps=1e-5, cfg=cfg).float(),
                               scale_rows_ref(F.linear(x.float(), w.float()), x.float(), 1e-5, b.float()),
                               atol=tol, rtol=tol)
    gate_up = torch.randn(1, 400, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    expect = r.float() + F.linear(silu_and_mul_ref(gate_up).float(), w.float())
    out = gemv(gate_up, w, residual=r, out=r, silu_mul=True, cfg=cfg)
    assert out.data_ptr() == r.data_ptr()
    torch.testing.assert_close(r.float(), expect, atol=tol, rtol=tol)
