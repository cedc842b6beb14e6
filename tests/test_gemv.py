"""The small-batch GEMV (slipstream.ops.triton_gemv) against F.linear: bias, the residual
added in place, strided inputs, every padded row count; and when the linear layers take it.

On CPU the kernel runs under Triton's interpreter (tests/conftest.py) at tiny sizes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.ops.triton_gemv import GemvConfig, choose_block_n, gemv, gemv_applies

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = GemvConfig(tile_elems=2048)  # K = 200 (padded to 256): 1-8 columns a program


def _data(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (w, x, b, r)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
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
    assert not gemv_applies(torch.empty(1, 4096), torch.empty(4096, 4096, dtype=torch.bfloat16))  # 8B's o: 32 MiB
    assert not gemv_applies(torch.empty(1, 16384), torch.empty(16, 16384))  # K past max_k
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
