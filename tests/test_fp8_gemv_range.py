"""Every FP8 kernel that narrows or quantizes activations, with activations far outside f16's
range: rows of 1e-12 and 1e-6, spikes of 1e6 and 1e9 beside O(1) values, an all-zero row.

- The MMA GEMV (ops/triton_fp8_gemv_mma.py) splits each row into two f16 parts after scaling
  it by a power of two (ops/triton_f16_split.py): every epilogue and layout against the fp32
  weight-only reference, with bounds relative to each row, and the split itself against a
  tensor core that flushes f16 subnormals (emulated on its outputs).
- The per-token and per-tensor quantization (ops/triton_fp8_quant*.py) round once to e4m3,
  subnormals included: bit for bit the reference's cast.
- The skinny and Triton FP8 GEMMs against the activation-quantized reference, row by row.

CPU: the kernels under Triton's interpreter at tiny sizes (tests/conftest.py). On a GPU the
same tests run on the device.
"""
from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl

from slipstream.ops.fp8_linear import fp8_linear_ref
from slipstream.ops.fused import scale_rows_ref, silu_and_mul_ref
from slipstream.ops.triton_f16_split import row_amax, row_scales, split_f16
from slipstream.ops.triton_fp8_gemm import Fp8GemmConfig, fp8_gemm
from slipstream.ops.triton_fp8_gemm_skinny import Fp8SkinnyConfig, fp8_gemm_skinny
from slipstream.ops.triton_fp8_gemv import Fp8GemvConfig, fp8_gemv
from slipstream.ops.triton_fp8_quant import quantize_rows
from slipstream.ops.triton_fp8_quant_tensor import quantize_tensor
from slipstream.quant.fp8 import (
    Fp8Weight,
    quantize_blocks,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MMA_TINY = Fp8GemvConfig(mma_block_n=16, mma_block_k=64, mma_warps=2, mma_stages=2)
# the output's rounding to bf16: half an ulp (2^-8 relative) on a GPU, a whole one under the
# interpreter, whose bf16 casts truncate
ROUNDING = 2 ** -8 if DEVICE == "cuda" else 2 ** -7


def _weight(n: int, k: int, layout: str = "channel", gamma: bool = False, seed: int = 0) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    quant = {"tensor": quantize_per_tensor, "channel": quantize_per_channel,
             "block": lambda t: quantize_blocks(t, (16, 32))}[layout]
    q, s = quant(w)
    gm = (torch.rand(k, generator=g) + 0.5).to(DEVICE) if gamma else None
    return Fp8Weight(q.to(DEVICE), s.to(DEVICE), (16, 32) if layout == "block" else None, gm)


def _extreme_rows(k: int, seed: int = 1) -> torch.Tensor:
    """[6, k] bf16: O(1) values; 1e6 spikes in 8 columns; 1e9 spikes (2^14 past f16's largest
    value times the old fixed split's 2^8); a row of 1e-6; a row of 1e-12; zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, k, generator=g) * 3
    x[1, ::20] = 1e6
    x[2, 3::17] = -1e9
    x[3] *= 1e-6
    x[4] *= 1e-12
    x[5] = 0.0
    return x.to(torch.bfloat16).to(DEVICE)


def _close_rows(y: torch.Tensor, ref: torch.Tensor, extra: torch.Tensor | float = 0.0) -> None:
    """Each row on its own scale: |y - ref| <= ROUNDING |ref| + 2^-10 max |ref of the row|
    (+ extra): a 1e-12 row is held to its own size, not to its neighbours'."""
    assert torch.isfinite(y.float()).all()
    err = (y.float() - ref).abs()
    bound = ref.abs() * ROUNDING + ref.abs().amax(dim=1, keepdim=True) * 2 ** -10 + extra
    worst = (err - bound).amax(dim=1)
    assert (worst <= 0).all(), f"rows over their bound by {worst.tolist()} (max errors {err.amax(dim=1).tolist()})"


@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
@pytest.mark.parametrize("split", [1, 3])
def test_mma_gemv_keeps_each_rows_range(layout, split):
    """Six extreme rows in one launch (each row takes its own power of two; split-K slices
    their own), plus each row alone (one row's launch: the engine's batch 1)."""
    w, x = _weight(48, 160, layout), _extreme_rows(160)
    cfg = Fp8GemvConfig(**{**MMA_TINY.__dict__, "mma_split_k": split})
    _close_rows(fp8_gemv(x, w, cfg=cfg), fp8_linear_ref(x.float(), w))
    for row in (1, 2, 4):
        _close_rows(fp8_gemv(x[row:row + 1], w, cfg=cfg), fp8_linear_ref(x[row:row + 1].float(), w))


def test_mma_gemv_norm_and_residual_epilogues_with_extreme_rows():
    """gamma and the row scale (qkv: x is the raw residual stream, rstd applied at the end), and
    o's residual added in place."""
    w, x = _weight(48, 160, gamma=True), _extreme_rows(160)[:5]  # rstd of a zero row is 1/sqrt(eps)
    ref = scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-30, None)
    _close_rows(fp8_gemv(x, w, row_scale_eps=1e-30, cfg=MMA_TINY), ref)
    w = _weight(48, 160)
    r = torch.zeros(5, 48, dtype=torch.bfloat16, device=DEVICE)
    expect = fp8_linear_ref(x.float(), w)
    assert fp8_gemv(x, w, residual=r, out=r, cfg=MMA_TINY) is r
    _close_rows(r, expect)


def test_mma_gemv_silu_mul_input_with_extreme_rows():
    """down: silu(gate) * up as the input, each row's range taken from the bound
    B = max(min(|g|, max(g, 0.28)) |up|) (no exponential). Rows with positive gates or tiny
    ones (the 1e-12 row) are held to their own size; a row whose every gate is -30
    (silu ~ -3e-12, B ~ 0.28 max |up|) is held to
    2^-25 B sum |w| absolutely (its parts fall below f16's normal range relative to B), far
    below the rounding of the residual that down adds into."""
    w = _weight(48, 80)
    gate_up = _extreme_rows(160)
    gate_up[0, :80] = -30.0
    a = silu_and_mul_ref(gate_up).float()
    expect = fp8_linear_ref(a, w)
    out = fp8_gemv(gate_up, w, silu_mul=True, cfg=MMA_TINY)
    wabs = w.dequantized(torch.float32).abs()
    # the input is rounded to bf16 in both, from sigmoids computed apart: an ulp of each value
    extra = ROUNDING * (a.abs() @ wabs.T)
    gate, up = gate_up.float()[:, :80], gate_up.float()[:, 80:]
    b = (torch.minimum(gate.abs(), gate.clamp(min=0.28)) * up.abs()).amax(dim=1, keepdim=True)
    _close_rows(out[1:], expect[1:], extra[1:])
    _close_rows(out[:1], expect[:1], extra[:1] + 2 ** -25 * b[:1] * wabs.sum(dim=1))
    assert b[0].item() > 1e10 * a[0].abs().max().item()  # the case is the bound's loosest


def test_the_range_pass_steps_and_groups():
    """A step reads ~2,048 values (1,024 of [gate | up]); up to 8 unrolled steps a group."""
    from slipstream.ops.triton_f16_split import prepass_steps
    assert prepass_steps(1, 1024, False) == (1024, 1, 1)  # qkv at one row, split 4: one step
    assert prepass_steps(16, 1792, True) == (64, 4, 8)  # down at 16 rows, split 8: 28 steps (4 masked)
    assert prepass_steps(16, 7168, True) == (64, 14, 8)  # a 70B down: 112 steps, 14 groups


def test_mma_gemv_range_pass_over_several_groups():
    """16 rows of [gate | up] 2 x 640 wide, K unsplit: 10 steps of 64 columns, two groups of 8
    (the second partly past the row), the largest values in the last step."""
    w = _weight(48, 640)
    gate_up = _extreme_rows(1280)[torch.arange(16) % 6].contiguous()
    gate_up[::3, 639] = 3e4  # a gate in the last step
    gate_up[::3, 1279] = -3e4  # and its up
    a = silu_and_mul_ref(gate_up).float()
    cfg = Fp8GemvConfig(**{**MMA_TINY.__dict__, "mma_split_k": 1})
    out = fp8_gemv(gate_up, w, silu_mul=True, cfg=cfg)
    extra = ROUNDING * (a.abs() @ w.dequantized(torch.float32).abs().T)
    _close_rows(out, fp8_linear_ref(a, w), extra)


@triton.jit
def _split_kernel(x_ptr, hi_ptr, lo_ptr, inv_ptr, K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M_PAD
    scale, inverse = row_scales(row_amax(x_ptr, x_ptr, offs_m, mmask, 0, K, K, K, 16, 2, K // 32, False, False))
    v = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :]).to(tl.float32)
    hi, lo = split_f16(v, scale[:, None])
    tl.store(hi_ptr + offs_m[:, None] * K + offs_k[None, :], hi)
    tl.store(lo_ptr + offs_m[:, None] * K + offs_k[None, :], lo)
    tl.store(inv_ptr + offs_m, inverse)


def test_the_split_survives_tensor_cores_that_flush_f16_subnormals():
    """The parts of each row, with every f16 subnormal flushed to zero (what a tensor core
    without subnormal support would read), still give each value to 2^-22 of itself plus
    2^-26 of its row's largest; no part exceeds 2^14 (f16 overflows at 65504)."""
    x = _extreme_rows(64).float()
    x[0, 5] = 2.0 ** -30  # a tiny value beside O(1) ones: below the row's range, lost
    xs = torch.cat([x, torch.zeros(2, 64, device=DEVICE)])  # rows padded to a power of two
    hi, lo = (torch.empty(8, 64, dtype=torch.float16, device=DEVICE) for _ in range(2))
    inv = torch.empty(8, dtype=torch.float32, device=DEVICE)
    _split_kernel[(1,)](xs, hi, lo, inv, K=64, M_PAD=8, BLOCK_K=64)
    assert hi.float().abs().max() <= 2 ** 14 and torch.isfinite(lo.float()).all()

    def flush(t):
        return torch.where(t.float().abs() < 2 ** -14, 0.0, t.float()).double()

    back = (flush(hi) + flush(lo)) * inv.double()[:, None]
    amax = xs.abs().amax(dim=1, keepdim=True).double()
    err = (back - xs.double()).abs()
    assert (err <= 2 ** -22 * xs.double().abs() + 2 ** -26 * amax).all(), err.max()
    # powers of two that put each row's largest value in [2^13, 2^14), and 2^-126 for zeros
    scaled = amax[:5, 0] / inv.double()[:5]
    assert ((scaled >= 2 ** 13) & (scaled < 2 ** 14)).all(), scaled
    assert inv[5].item() == 2.0 ** -126


# --- the activation quantization and the GEMMs that read it ---

def _codes(q: torch.Tensor) -> torch.Tensor:
    """e4m3 codes with -0 read as +0: the GPU's kernels may give a negative value that
    rounds to zero either sign (an H100 gave +0 where torch's cast gives -0), which no product
    can tell apart."""
    u = q.view(torch.uint8)
    return torch.where(u == 0x80, torch.zeros_like(u), u)


@pytest.mark.parametrize("group", [None, 16])
def test_row_quantization_of_extreme_rows_rounds_once_as_the_reference(group):
    """Bit for bit the reference's cast (the sign of zero aside), e4m3 subnormals included (the
    O(1) values of a row with 1e6 spikes land there), and the dequantized values within half an
    e4m3 step."""
    x = _extreme_rows(80)
    q, s = quantize_rows(x, None, group)
    qr, sr = quantize_per_token(x.float(), group)
    assert torch.equal(s, sr)
    assert torch.equal(_codes(q), _codes(qr)), (_codes(q) != _codes(qr)).sum().item()
    g = group or 80
    scale = s.repeat_interleave(g, 1)[:, :80]
    err = (q.float() * scale - x.float()).abs()
    assert (err <= 2 ** -4 * x.float().abs() + 2 ** -10 * scale).all()


def test_tensor_quantization_of_extreme_rows_rounds_once_as_the_reference():
    for rows in (slice(0, 2), slice(3, 5)):  # with 1e6 spikes; the 1e-6 and 1e-12 rows alone
        x = _extreme_rows(80)[rows]
        q, s = quantize_tensor(x)
        qr, sr = quantize_per_tensor(x.float())
        assert s.item() == sr[0].item()
        assert torch.equal(_codes(q), _codes(qr)), (_codes(q) != _codes(qr)).sum().item()


@pytest.mark.parametrize("block", [None, (16, 32)])
@pytest.mark.parametrize("kernel", ["skinny", "skinny-split", "triton"])
def test_gemms_with_extreme_rows_match_the_activation_quantized_reference(block, kernel):
    """Each row against the reference that quantizes it the same way, on its own scale."""
    w = _weight(48, 160, "block" if block else "channel", gamma=True)
    x = _extreme_rows(160)
    ref = fp8_linear_ref(x.float(), w, quantize_input=True)
    if kernel == "triton":
        y = fp8_gemm(x, w, None, Fp8GemmConfig(block_m=16, block_n=16, block_k=32))
    else:
        y = fp8_gemm_skinny(x, w, None, Fp8SkinnyConfig(block_n=16, block_m=16, block_k=32,
                                                        split_k=2 if kernel == "skinny-split" else 1))
    _close_rows(y, ref)


# --- the GPU: the 8B shape's products at the engine's tiles and splits, on tensor cores ---

def _extreme_batch(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """m rows cycling through `_extreme_rows`' six kinds."""
    x = _extreme_rows(k, seed)
    return x[torch.arange(m) % 6].contiguous()


@functools.lru_cache(maxsize=8)
def _gpu_weight(n: int, k: int, gamma: bool, layout: str) -> Fp8Weight:
    """A random FP8 weight at the 8B shape's sizes, made once for the row counts (read-only)."""
    block = (128, 128) if layout == "block" else None
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    q, s = quantize_blocks(w, block) if block else quantize_per_channel(w)
    gm = (torch.rand(k, generator=g) + 0.5).to(DEVICE) if gamma else None
    return Fp8Weight(q.to(DEVICE), s.to(DEVICE), block, gm)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("m", [1, 4, 6, 16])
def test_gpu_gemv_keeps_each_rows_range_at_8b_sizes(m, layout):
    """qkv with the folded norm (x the raw residual stream), o into the residual (split-K),
    gate_up, and down with SiLU·mul of extreme rows, at the default config: on the GPU's
    tensor cores, whatever they do with f16 subnormals."""
    def weight(n, k, gamma):
        return _gpu_weight(n, k, gamma, layout)

    for n, k, gamma in [(6144, 4096, True), (4096, 4096, False), (28672, 4096, True)]:
        w, x = weight(n, k, gamma), _extreme_batch(m, k)
        if gamma:  # eps small enough that a 1e-12 row's rstd is its own
            ref = scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-30, None)
            _close_rows(fp8_gemv(x, w, row_scale_eps=1e-30), ref)
        else:
            r = torch.zeros(m, n, dtype=torch.bfloat16, device=DEVICE)
            _close_rows(fp8_gemv(x, w, residual=r, out=r), fp8_linear_ref(x.float(), w))
    w, gate_up = weight(4096, 14336, False), _extreme_batch(m, 2 * 14336)
    a = silu_and_mul_ref(gate_up).float()
    extra = ROUNDING * (a.abs() @ w.dequantized(torch.float32).abs().T)
    _close_rows(fp8_gemv(gate_up, w, silu_mul=True), fp8_linear_ref(a, w), extra)
