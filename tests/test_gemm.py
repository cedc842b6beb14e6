"""The batch-invariant GEMM: values against F.linear, and rows that do not depend on the batch.

On CPU the kernel runs under Triton's interpreter (tests/conftest.py) at tiny sizes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.ops.linear import linear
from slipstream.ops.triton_gemm import GemmConfig, choose_splits, invariant_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = GemmConfig(block_m=16, block_n=32, block_k=16, min_k_per_split=32, programs_per_sm=1)


def _weights(n, k, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    a = torch.randn(70, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return w.to(device), a.to(device), b.to(device)


def test_choose_splits_depends_on_the_weight_only():
    # (N, K, SMs) -> splits whose ranges are BLOCK_K multiples covering K exactly
    for n, k in [(96, 200), (4096, 4096), (128, 64), (6144, 14336)]:
        splits, per = choose_splits(n, k, GemmConfig(), 132)
        assert per % GemmConfig().block_k == 0 and (splits - 1) * per < k <= splits * per
    assert choose_splits(4096, 4096, GemmConfig(), 132) == (8, 512)  # 32 N-tiles: 8 ranges
    assert choose_splits(128256, 4096, GemmConfig(), 132)[0] == 1  # enough N-tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_values_match_f_linear(dtype):
    w, a, b = _weights(96, 200, dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for in_program in (True, False):
        y = invariant_linear(a, w, b, TINY, in_program=in_program)
        assert y.dtype == dtype and y.shape == (70, 96)
        torch.testing.assert_close(y.float(), F.linear(a.float(), w.float(), b.float()), atol=tol, rtol=tol)
    y3 = invariant_linear(a.reshape(7, 10, 200), w, None, TINY)  # leading dims are kept
    assert y3.shape == (7, 10, 96)
    assert invariant_linear(a[:0], w, None, TINY).shape == (0, 96)


@pytest.mark.slow
def test_rows_do_not_depend_on_the_batch():
    # the same bits for a row alone, in a small batch (one split per program, then a sum
    # pass) and in a large one (all splits in one program)
    w, a, b = _weights(96, 200, torch.bfloat16, seed=1)
    full_split = invariant_linear(a, w, b, TINY, in_program=False)
    full_inprog = invariant_linear(a, w, b, TINY, in_program=True)
    assert torch.equal(full_split, full_inprog)
    for m in (1, 5, 17, 33):
        assert torch.equal(invariant_linear(a[:m], w, b, TINY), full_inprog[:m])
    assert torch.equal(invariant_linear(a[40:41], w, b, TINY), full_inprog[40:41])


def test_bad_shapes_and_the_cpu_dispatch():
    w, a, _ = _weights(96, 200, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="K=200"):
        invariant_linear(a[:, :100], w)
    # CPU tensors take the torch path whatever the flag says
    assert torch.equal(linear(a, w, None, batch_invariant=True), F.linear(a, w))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1024, 2048)])
def test_gpu_rows_bitwise_invariant_real_shapes(n, k):
    w, _, _ = _weights(n, k, torch.bfloat16, seed=2)
    a = torch.randn(4100, k, device="cuda", dtype=torch.bfloat16)
    full = invariant_linear(a, w)
    torch.testing.assert_close(full.float(), F.linear(a, w).float(), atol=5e-2, rtol=5e-2)
    for m in (1, 7, 32, 64, 200, 1024):  # both layouts (split programs below ~2 x SMs tiles)
        assert torch.equal(invariant_linear(a[:m], w), full[:m]), m
    assert torch.equal(invariant_linear(a[1000:1032], w), full[1000:1032])
    assert torch.equal(invariant_linear(a[:32], w, in_program=True), invariant_linear(a[:32], w, in_program=False))
