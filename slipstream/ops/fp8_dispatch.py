"""Which kernel multiplies an FP8 weight at how many rows, on CUDA (not batch-invariant; the
one-row GEMV decides before this table: ops/fp8_linear.py `_gemv_applies`).

The table is per weight layout (per-tensor / per-channel, 128x128 blocks): routes sorted by
`up_to_rows`, the first that holds the batch's rows wins, the last one takes any count. The
defaults follow `benchmarks/bench_fp8_gemm.py` and `bench_fp8_skinny.py` on an H100 (the
fastest kernel at each row count, activation quantization included): per channel the skinny
kernel up to 64 rows, then `_scaled_mm` with fast accumulation (the 8B layer's four products
at 8-16 K rows 1.66-1.70x bf16's TFLOP/s, fp32 accumulation 1.48-1.55x; docs/fp8.md).
`SLIPSTREAM_FP8_ROUTES` overrides them (A/B runs), e.g.

    SLIPSTREAM_FP8_ROUTES="channel=skinny:64,scaled_mm/block=skinny:256,triton"

(layouts apart by '/' or ';': gpu_run.sh's ab-env takes ';' between its arms).

Kernels (each quantizes its input per token, per token and 128-column group for blocks):
- `scaled_mm`: `torch._scaled_mm` (cuBLASLt / CUTLASS) with row-wise scales, fp32 accumulation
  promoted out of the tensor cores (per-tensor / per-channel weights only);
- `scaled_mm_fast`: the same with `use_fast_accum=True`: the whole K summed in the tensor
  cores' accumulator (docs/fp8.md, "Fast accumulation");
- `skinny`: ops/triton_fp8_gemm_skinny.py, operands swapped so few rows fill the MMA's narrow
  side, K split when N gives too few programs; the residual added in its epilogue;
- `triton`: ops/triton_fp8_gemm.py, 64-row tiles (the batch-invariant kernel); residual in
  its epilogue; `tb-mMnNwWsS[p]` (`Fp8GemmConfig.name`) is the same kernel with another tile,
  warps, stages (p: persistent), as the bench names them;
- `scaled_mm_block`: torch's block-scaled `_scaled_mm` (1x128 input groups, 128x128 weight
  blocks; cuBLASLt 12.9+ on sm_90), block weights only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from slipstream.ops.triton_fp8_gemm import parse_tile_name
from slipstream.quant.fp8 import Fp8Weight

if TYPE_CHECKING:
    from slipstream.ops.triton_fp8_quant import SiluMulRows

KERNELS = ("scaled_mm", "scaled_mm_fast", "skinny", "triton", "scaled_mm_block")
CHANNEL_KERNELS = ("scaled_mm", "scaled_mm_fast", "skinny", "triton")
BLOCK_KERNELS = ("skinny", "triton", "scaled_mm_block")
# kernels that add a residual in their epilogue (rounded once, in place), and any tb- tile
RESIDUAL_KERNELS = ("skinny", "triton")
ANY_ROWS = 1 << 62


@dataclass(frozen=True)
class Fp8Route:
    up_to_rows: int
    kernel: str


@dataclass(frozen=True)
class Fp8Dispatch:
    channel: tuple[Fp8Route, ...] = (Fp8Route(64, "skinny"), Fp8Route(ANY_ROWS, "scaled_mm_fast"))
    block: tuple[Fp8Route, ...] = (Fp8Route(256, "skinny"), Fp8Route(ANY_ROWS, "triton"))

    def kernel_for(self, rows: int, block: bool) -> str:
        for route in self.block if block else self.channel:
            if rows <= route.up_to_rows:
                return route.kernel
        raise AssertionError("the last route takes any rows")


def _parse_routes(text: str, allowed: tuple[str, ...], layout: str) -> tuple[Fp8Route, ...]:
    routes = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        kernel, _, rows = part.partition(":")
        if kernel not in allowed and parse_tile_name(kernel) is None:
            raise ValueError(f"FP8 routes: kernel {kernel!r} for {layout} weights is not one of "
                             f"{', '.join(allowed)} or tb-mMnNwWsS[p]")
        last = i == len(text.split(",")) - 1
        if not rows and not last:
            raise ValueError(f"FP8 routes: {layout} route {part!r} needs ':ROWS' (only the last takes any rows)")
        if rows and not rows.isdigit():
            raise ValueError(f"FP8 routes: {layout} route {part!r}: ROWS must be a positive integer")
        limit = int(rows) if rows and not last else ANY_ROWS
        if routes and limit <= routes[-1].up_to_rows:
            raise ValueError(f"FP8 routes: {layout} row limits must increase ({text!r})")
        routes.append(Fp8Route(limit, kernel))
    return tuple(routes)


def parse_dispatch(text: str, base: Fp8Dispatch = Fp8Dispatch()) -> Fp8Dispatch:
    """`channel=K:ROWS,...,K/block=K:ROWS,...,K` (or ';' between the two; either part may be
    left out: the default's)."""
    parts = {}
    for part in filter(None, (p.strip() for p in text.replace(";", "/").split("/"))):
        layout, _, routes = part.partition("=")
        if layout not in ("channel", "block") or not routes:
            raise ValueError(f"FP8 routes: {part!r} is not 'channel=...' or 'block=...'")
        allowed = CHANNEL_KERNELS if layout == "channel" else BLOCK_KERNELS
        parts[layout] = _parse_routes(routes, allowed, layout)
    return Fp8Dispatch(parts.get("channel", base.channel), parts.get("block", base.block))


DISPATCH = parse_dispatch(os.environ.get("SLIPSTREAM_FP8_ROUTES", ""))


def scaled_mm_rowwise(x: torch.Tensor | SiluMulRows, w: Fp8Weight, fast_accum: bool = False) -> torch.Tensor:
    """x quantized per token, then `torch._scaled_mm` with row-wise scales, in x's dtype."""
    from slipstream.ops.triton_fp8_quant import quantize_rows
    q, s = quantize_rows(x, w.gamma)
    return torch._scaled_mm(q, w.qweight.t(), scale_a=s, scale_b=w.scale[None, :], out_dtype=x.dtype,
                            use_fast_accum=fast_accum)


def scaled_mm_blockwise(x: torch.Tensor | SiluMulRows, w: Fp8Weight) -> torch.Tensor:
    """x quantized per token and 128-column group, then torch's block-scaled `_scaled_mm`:
    the input's scales [M, K/128] M-major, the weight's [K/128, N/128] K-major (the layouts
    cuBLASLt reads; the weight's [N/128, K/128] row-major transposed is already that)."""
    from slipstream.ops.triton_fp8_quant import quantize_rows
    if w.block != (128, 128):
        raise ValueError(f"block-scaled _scaled_mm needs 128x128 weight blocks, not {w.block}")
    q, s = quantize_rows(x, w.gamma, 128)
    s_a = s.t().contiguous().t()  # [M, K/128] with the M stride 1
    return torch._scaled_mm(q, w.qweight.t(), scale_a=s_a, scale_b=w.scale.t(), out_dtype=x.dtype)


def adds_residual(kernel: str) -> bool:
    return kernel in RESIDUAL_KERNELS or parse_tile_name(kernel) is not None


def fp8_product(x: torch.Tensor | SiluMulRows, w: Fp8Weight, bias: torch.Tensor | None, kernel: str,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) by `kernel` (x may be a `SiluMulRows`, quantized with its SiLU·mul
    in one pass); with a residual (only `RESIDUAL_KERNELS`) the
    product is added to it in the epilogue, into `out`."""
    if kernel == "skinny":
        from slipstream.ops.triton_fp8_gemm_skinny import fp8_gemm_skinny
        return fp8_gemm_skinny(x, w, bias, residual=residual, out=out)
    if kernel == "triton":
        from slipstream.ops.triton_fp8_gemm import fp8_gemm
        return fp8_gemm(x, w, bias, residual=residual, out=out)
    tile = parse_tile_name(kernel)
    if tile is not None:
        from slipstream.ops.triton_fp8_gemm import fp8_gemm
        return fp8_gemm(x, w, bias, tile, residual=residual, out=out)
    assert residual is None, kernel
    if kernel == "scaled_mm_block":
        y = scaled_mm_blockwise(x, w)
    elif kernel in ("scaled_mm", "scaled_mm_fast"):
        y = scaled_mm_rowwise(x, w, fast_accum=kernel == "scaled_mm_fast")
    else:
        raise ValueError(f"unknown FP8 kernel {kernel!r} (one of {', '.join(KERNELS)})")
    # the bias after (a decoder's qkv bias goes to the epilogue: only an o bias comes here),
    # not in cuBLASLt's epilogue, whose row-wise-scaled kernels do not all take one
    return y if bias is None else y.add_(bias)
