"""The FP8 kernels against their dequantized references (slipstream/ops/fp8_linear.py):
per-token activation quantization, the one-row FP8 GEMV, the FP8 GEMM (per-channel and
block scales, batch invariance), and the `_scaled_mm` path.

On the CPU the Triton kernels run under Triton's interpreter (tests/conftest.py) at tiny
sizes; the `gpu` tests run them at the 8B shape's sizes.
"""
from __future__ import annotations

import functools

import pytest
import torch
from helpers import rel_rms

from slipstream.ops.fp8_dispatch import DISPATCH
from slipstream.ops.fp8_linear import fp8_linear, fp8_linear_add_, fp8_linear_ref, fp8_norm_linear
from slipstream.ops.triton_fp8_gemm import Fp8GemmConfig, fp8_gemm
from slipstream.ops.triton_fp8_gemv import fp8_gemv
from slipstream.ops.triton_fp8_quant import quantize_rows
from slipstream.quant.fp8 import Fp8Weight, quantize_blocks, quantize_per_channel, quantize_per_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY_GEMM = Fp8GemmConfig(block_m=16, block_n=16, block_k=32)


def _weight(n: int, k: int, block, gamma: bool, seed: int = 0) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    q, s = quantize_blocks(w, block) if block else quantize_per_channel(w)
    gm = (torch.rand(k, generator=g) + 0.5) if gamma else None
    return Fp8Weight(q.to(DEVICE), s.to(DEVICE), block, gm.to(DEVICE) if gm is not None else None)


def _x(m: int, k: int, seed: int = 1, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 3).to(dtype).to(DEVICE)


# one pass from registers (per token and 16-column groups); two passes (a group over 16384
# columns; a 20000-column row of 16-column groups would be one pass again, and slow under the
# interpreter)
@pytest.mark.parametrize("m,k,group", [(5, 72, None), (5, 72, 16), (2, 20000, None)])
def test_row_quantization_equals_the_reference_bit_for_bit(m, k, group):
    x, gamma = _x(m, k), torch.rand(k).to(DEVICE) + 0.5
    q, s = quantize_rows(x, gamma, group)
    qr, sr = quantize_per_token(x.float() * gamma, group)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("block", [None, (16, 32)])
def test_gemm_matches_the_activation_quantized_reference(block):
    w = _weight(48, 96, block, True)
    x, b = _x(19, 96), _x(1, 48, seed=2)[0]
    ref = fp8_linear_ref(x.float(), w, b.float(), quantize_input=True)
    y = fp8_gemm(x, w, b, TINY_GEMM)
    torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=2e-2)


def test_gemm_adds_the_residual_in_place_rounded_once():
    w = _weight(48, 96, (16, 32), True)
    x, r = _x(7, 96), _x(7, 48, seed=6)
    expect = (r.float() + fp8_linear_ref(x.float(), w, quantize_input=True)).to(r.dtype)
    out = fp8_gemm(x, w, None, TINY_GEMM, residual=r, out=r)
    assert out.data_ptr() == r.data_ptr()
    torch.testing.assert_close(r.float(), expect.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("block", [None, (16, 32)])
def test_gemm_rows_are_batch_invariant(block):
    """A row's bits do not depend on the rows around it or their number."""
    w = _weight(48, 96, block, True)
    x = _x(21, 96)
    whole = fp8_gemm(x, w, None, TINY_GEMM)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
        assert torch.equal(fp8_gemm(x[rows], w, None, TINY_GEMM), whole[rows])
    other = x.clone()
    other[0] *= 100.0  # a loud neighbour changes nothing in the other rows
    assert torch.equal(fp8_gemm(other, w, None, TINY_GEMM)[1:], whole[1:])


def test_the_cpu_path_is_the_reference_and_adds_in_place():
    w = _weight(32, 64, None, True)
    x, out = _x(3, 64).cpu(), _x(3, 32, seed=5).cpu()
    w = Fp8Weight(w.qweight.cpu(), w.scale.cpu(), None, w.gamma.cpu())
    y = fp8_linear(x, w)
    assert torch.equal(y, fp8_linear_ref(x, w))
    expect = out + y
    assert fp8_linear_add_(out, x, w) is out
    torch.testing.assert_close(out, expect)
    h, finished = fp8_norm_linear(x, w, None, 1e-6)
    assert not finished and torch.equal(h, y)  # the epilogue applies rstd on the CPU


# --- the GPU: real sizes (the 8B shape), the kernels each path launches ---

def _rel_rms_within(bound: float):
    """An assertion that y's relative RMS error against ref is under `bound`."""
    def check(y: torch.Tensor, ref: torch.Tensor) -> None:
        err = rel_rms(y, ref)
        assert err < bound, f"relative RMS error {err:.2e} over {bound:.2e}"
    return check


SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_gpu_gemv_at_8b_sizes(n, k, block):
    w = _weight(n, k, block, True)
    x = _x(1, k)
    ref = fp8_linear_ref(x.float(), w)
    torch.testing.assert_close(fp8_gemv(x, w).float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [2, 37, 256, 8192])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_gpu_gemm_and_scaled_mm_at_8b_sizes(n, k, m, block):
    w = _weight(n, k, block, True)
    x, b = _x(m, k), _x(1, n, seed=2)[0]
    ref = fp8_linear_ref(x.float(), w, b.float(), quantize_input=True)
    # fp32 sums in another order, one bf16 rounding of the output
    tol = dict(atol=3e-2 * ref.abs().max().item() / 8, rtol=2e-2)
    torch.testing.assert_close(fp8_gemm(x, w, b).float(), ref, **tol)
    # the routed kernel (skinny, _scaled_mm or the block GEMMs), the input quantized as ref's;
    # fast-accumulating _scaled_mm sums K in the tensor cores: its bound is relative RMS
    # (tests/test_fp8_gemm_mid.py, fast accumulation), not each output's
    check = _rel_rms_within(2 ** -6) if DISPATCH.kernel_for(m, block is not None) == "scaled_mm_fast" else \
        functools.partial(torch.testing.assert_close, **tol)
    check(fp8_linear(x, w, b).float(), ref)
    r = _x(m, n, seed=7)
    check(fp8_linear_add_(r.clone(), x, w, b).float(), r.float() + ref)
    inv = fp8_linear(x, w, batch_invariant=True)
    assert torch.equal(fp8_linear(x[:1], w, batch_invariant=True), inv[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_gpu_fp8_products_replay_in_a_cuda_graph(block):
    """The FP8 path under CUDA graphs: one row (the GEMV) and 64 rows (per-token quantization,
    then _scaled_mm or the block GEMM) captured once, replayed on new inputs, equal eager."""
    w = _weight(4096, 4096, block, True)
    for m in (1, 64):
        x = _x(m, 4096)
        out = torch.empty((m, 4096), dtype=torch.bfloat16, device=DEVICE)
        for _ in range(2):  # warm up (Triton compiles, cuBLASLt picks its kernel)
            out.copy_(fp8_linear(x, w))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(fp8_linear(x, w))
        x.copy_(_x(m, 4096, seed=9))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_linear(x, w))


# --- compiled for Hopper without a GPU (the interpreter misses what only the compiler rejects) ---

def compile_fp8_for_hopper() -> int:
    """Compile each FP8 kernel for sm_90 as the host code launches it at the 8B shape (bf16
    activations): the row quantization (per token, per 128-column group, SiLU·mul's input with
    its row scale) and the GEMM (per channel, 128x128 blocks, each after its input's
    quantization); tests/test_fp8_gemv.py compiles the GEMV. Returns the number of launches
    compiled."""
    from test_attention_kernels import compile_launch_for_hopper, recorded_launches

    import slipstream.ops.triton_fp8_gemm as tm
    import slipstream.ops.triton_fp8_quant as tq
    bf, f8 = torch.bfloat16, torch.float8_e4m3fn

    def weight(n, k, block, gamma=True):
        scale = torch.ones((n // 128, k // 128) if block else (n,))
        return Fp8Weight(torch.zeros(n, k, dtype=f8), scale, block, torch.ones(k) if gamma else None)

    launches: list = []
    with recorded_launches(tq, ["_quant_rows_kernel"], launches), \
            recorded_launches(tm, ["_fp8_gemm_kernel"], launches):
        x = torch.zeros(64, 14336, dtype=bf)
        tq.quantize_rows(x, torch.ones(14336))
        tq.quantize_rows(x, None, 128)
        tq.quantize_rows(tq.SiluMulRows(torch.zeros(64, 2 * 14336, dtype=bf), torch.zeros(64, 4096, dtype=bf), 1e-5))
        # (each GEMM launch comes after its input's quantization launch)
        tm.fp8_gemm(torch.zeros(256, 4096, dtype=bf), weight(6144, 4096, None))
        tm.fp8_gemm(torch.zeros(256, 4096, dtype=bf), weight(6144, 4096, (128, 128)), torch.zeros(6144, dtype=bf))
    for fn, args, kw in launches:
        ptx = compile_launch_for_hopper(fn, args, kw)[0].asm["ptx"]
        if fn.__name__ == "_quant_rows_kernel":
            # IEEE division, as the reference's: the approximate one moved scales and codes by a
            # bit against torch's cast on an H100 (SiLU's own division is silu_and_mul's)
            assert "div.rn.f32" in ptx
            assert kw["SILU_MUL"] or ("div.full" not in ptx and "div.approx" not in ptx)
        print("compiled", fn.__name__)
    return len(launches)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU tests compile the kernels")
def test_fp8_kernels_compile_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    assert out.count("compiled") == 7, out


if __name__ == "__main__":
    import sys
    if "--compile-for-hopper" in sys.argv:
        compile_fp8_for_hopper()
