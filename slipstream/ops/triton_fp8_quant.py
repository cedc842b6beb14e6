"""Dynamic FP8 quantization of activations: each row (token) of x [M, K], optionally times a
folded norm's gamma [K], to e4m3 with its own float32 scale amax / 448, either one scale a row
(`group` None: [M, 1], what `torch._scaled_mm`'s row-wise scaling reads) or one a row's
`group`-wide slice of K ([M, ceil(K / group)], the block-scaled GEMM's input).

A row is quantized by one program from its own values only, so the result does not depend on
the batch. The reference is `quant.fp8.quantize_per_token` on x * gamma
(tests/test_fp8_kernels.py); launches depend on shapes only (CUDA-graph safe).

`SiluMulRows` is the down product's input before SiLU·mul: [gate | up] rows (scaled by
rstd(hidden) first when the gate_up product left its folded norm's row scale to us). The
same kernel computes silu(gate) * up as `silu_and_mul` does (rounded to the input's dtype)
and quantizes it, so the [M, I] activation is never written in bf16 and read back: one kernel
and 4 M I bytes of traffic fewer a layer (`fp8_silu_mul_linear_add_`), the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_fused import row_block, row_rstd, silu_mul
from slipstream.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE


ONE_PASS_MAX = 16384


@dataclass(frozen=True)
class SiluMulRows:
    """The input silu(gate) * up of [gate | up] rows `gate_up` [M, 2I] (each row scaled by
    rstd(hidden [M, H], eps) first when `hidden` is given), left for the FP8 GEMMs to
    quantize in one pass (`quantize_rows`). Shaped like that input: [M, I]."""
    gate_up: torch.Tensor
    hidden: torch.Tensor | None = None
    eps: float = 1e-6

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.gate_up.shape[0], self.gate_up.shape[1] // 2))

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype

    @property
    def device(self) -> torch.device:
        return self.gate_up.device


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32: integer
    arithmetic, so the value is the GPU's bf16 cast's whatever the cast's implementation
    (Triton's interpreter, which runs the CPU tests, truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_scaled(x_ptr, g_ptr, offs, mask, K, r, HAS_GAMMA: tl.constexpr, SILU_MUL: tl.constexpr,
                 HAS_R: tl.constexpr):
    """A chunk of the row in fp32: x * gamma, or silu(gate * r) * (up * r) rounded to x's
    dtype (`silu_and_mul`'s values) when SILU_MUL (x is [gate | up], K the width of each)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SILU_MUL:
        g = x.to(tl.float32)
        u = tl.load(x_ptr + K + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_R:
            g = g * r
            u = u * r
        y = silu_mul(g, u)
        x = _round_bf16(y) if x.dtype == tl.bfloat16 else y.to(x.dtype).to(tl.float32)
    x = x.to(tl.float32)
    if HAS_GAMMA:
        x = x * tl.load(g_ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _round_mantissa3(x):
    """x rounded to the nearest e4m3 value (ties to even) in fp32: 3 mantissa bits for normal
    values (integer arithmetic carries into the exponent), multiples of 2^-9 below 2^-6 (e4m3's
    subnormals, where a row's small values land beside a large one). The cast to e4m3 that
    follows is then exact, so the value is rounded once, as the reference's single cast rounds
    it, whatever the cast's implementation (Triton's interpreter, which runs the CPU tests,
    does not carry and flushes some subnormals; a second rounding on the GPU's cast would
    round 1.0625 x 2^-10 to 0)."""
    sign = x.to(tl.int32, bitcast=True)
    bits = (sign + 0x7FFFF + ((sign >> 20) & 1)) & -0x100000  # drop 20 of fp32's 23 bits
    # fp32's ulp at 2^14 is 2^-9: its own addition rounds |x| to the subnormal grid; the sign
    # goes back on after (a negative value that rounds to zero is -0, as the cast gives)
    a = tl.abs(x)
    tiny = (a + 16384.0) - 16384.0
    tiny = tl.where(sign < 0, -tiny, tiny)
    return tl.where(a < 0.015625, tiny, bits.to(tl.float32, bitcast=True))


@triton.jit
def scale_from_amax(amax, FMAX: tl.constexpr, SMIN: tl.constexpr):
    """amax / FMAX (IEEE division, as below), at least SMIN: a row's, group's or tensor's scale."""
    return tl.maximum(tl.math.div_rn(amax, tl.full([], FMAX, tl.float32)), SMIN)


@triton.jit
def quantize_chunk(x, scale, FMAX: tl.constexpr):
    """x / scale rounded once to e4m3's grid and saturated, in fp32 (IEEE division, div_rn:
    Triton's `/` on float32 is the GPU's approximate division, whose last bit can flip a code
    against the reference's cast)."""
    x = tl.math.div_rn(x, scale + tl.zeros(x.shape, tl.float32))
    return tl.minimum(tl.maximum(_round_mantissa3(x), -FMAX), FMAX)


@triton.jit
def _quant_rows_kernel(x_ptr, g_ptr, h_ptr, q_ptr, s_ptr, K, stride_xm, stride_hm, stride_qm, stride_sm, eps,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr, HAS_GAMMA: tl.constexpr,
                       SILU_MUL: tl.constexpr, N_HIDDEN: tl.constexpr, BLOCK_HID: tl.constexpr,
                       FMAX: tl.constexpr, SMIN: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, group). A group that fits one BLOCK is loaded once and quantized from
    registers (one trip to memory: at decode sizes the kernel is latency, not bytes); a wider
    one takes its amax in a first pass over BLOCK-wide chunks and the values in a second (the
    row is in L2 by then). N_HIDDEN > 0: the row scale rstd(hidden row) of SiLU·mul's input."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * GROUP
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    r = 1.0
    if N_HIDDEN > 0:
        r = row_rstd(h_ptr + row * stride_hm, eps, N_HIDDEN, BLOCK_HID)
    if BLOCK >= GROUP:
        idx = lo + offs
        mask = (idx < K) & (offs < GROUP)
        x = _load_scaled(x_row, g_ptr, idx, mask, K, r, HAS_GAMMA, SILU_MUL, N_HIDDEN > 0)
        scale = scale_from_amax(tl.max(tl.abs(x), axis=0), FMAX, SMIN)
        tl.store(q_row + idx, quantize_chunk(x, scale, FMAX).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.range(0, GROUP, BLOCK):
            idx = lo + k + offs
            mask = (idx < K) & (k + offs < GROUP)
            amax = tl.maximum(amax, tl.abs(_load_scaled(x_row, g_ptr, idx, mask, K, r, HAS_GAMMA, SILU_MUL,
                                                        N_HIDDEN > 0)))
        scale = scale_from_amax(tl.max(amax, axis=0), FMAX, SMIN)
        for k in tl.range(0, GROUP, BLOCK):
            idx = lo + k + offs
            mask = (idx < K) & (k + offs < GROUP)
            x = _load_scaled(x_row, g_ptr, idx, mask, K, r, HAS_GAMMA, SILU_MUL, N_HIDDEN > 0)
            tl.store(q_row + idx, quantize_chunk(x, scale, FMAX).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, scale)


def quantize_rows(x: torch.Tensor | SiluMulRows, gamma: torch.Tensor | None = None,
                  group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, K], scale float32 [M, G]) of x [M, K] (times gamma), or of a
    `SiluMulRows`'s silu(gate) * up computed on the way."""
    m, k = x.shape
    hidden, eps, silu = None, 0.0, isinstance(x, SiluMulRows)
    if silu:
        if gamma is not None:
            raise ValueError("a SiLU·mul input takes no folded norm's gamma")
        hidden, eps, x = x.hidden, x.eps, x.gate_up
        if hidden is not None and hidden.stride(1) != 1:
            hidden = hidden.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    g = group or k
    groups = triton.cdiv(k, g)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    # one pass up to ONE_PASS_MAX columns a group (at most 32 values a thread), two above
    block = triton.next_power_of_2(g)
    block = block if block <= ONE_PASS_MAX else 2048
    num_warps = max(4, min(16, block // 1024))
    n_hidden = hidden.shape[1] if hidden is not None else 0
    _quant_rows_kernel[(m, groups)](
        x, gamma if gamma is not None else x, hidden if hidden is not None else x, q, s, k, x.stride(0),
        hidden.stride(0) if hidden is not None else 0, q.stride(0), s.stride(0), float(eps),
        GROUP=g, BLOCK=block, HAS_GAMMA=gamma is not None, SILU_MUL=silu, N_HIDDEN=n_hidden,
        BLOCK_HID=row_block(n_hidden), FMAX=FP8_MAX, SMIN=MIN_SCALE, num_warps=num_warps, **pdl_launch(x.device))
    return q, s
