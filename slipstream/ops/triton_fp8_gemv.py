"""Small-batch linear layers with FP8 weights: y[M, N] = (x * gamma)[M, K] @ (q * scale)[N, K]^T
for M <= 16 rows (the engine takes it up to `Fp8GemvConfig.max_rows`, one row), weight-only:
the input rows stay in their dtype (no activation quantization), the FP8 weight is upcast in
registers.

At small batches a decode step reads every weight once; its time is the weight's bytes, half
of bf16's in FP8. `_fp8_gemv_mma_kernel` (ops/triton_fp8_gemv_mma.py) streams them: each
program owns a block of weight rows and walks K in tiles, the weight tile converted to f16 and
multiplied on tensor cores against the input rows, so a weight byte costs its half
conversion and no FMA, and 16 rows cost what one does. (A one-row kernel with the products
in fp32 FMAs issued 3.6-4.6 SASS instructions a weight byte against this one's 1.2 and ran
the 8B layer's four products in 136 µs against 107 on an H100: removed.)

Scales: per channel (and per tensor, held per channel) multiply the column's sum once at the
end; with 128 x 128 block scales each block's partial sum is multiplied by its block's scale
(the K tile is one block). Around the product, as in the bf16 GEMV: a folded norm's gamma
scales the input's columns, `row_scale_eps` multiplies by rstd(x) (computed on x itself,
before gamma), SiLU·mul computes the input from [gate | up], then the bias and the residual
are added in fp32 before the one rounding. CUDA-graph safe (launches depend on shapes only);
PDL like the other kernels of a step. The reference is `ops.fp8_linear.fp8_linear_ref`
(tests/test_fp8_gemv.py, tests/test_fp8_kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.ops.device import sm_count
from slipstream.ops.triton_fp8_gemv_mma import fp8_gemv_mma
from slipstream.quant.fp8 import Fp8Weight
from slipstream.utils.overrides import config_from_env


@dataclass(frozen=True)
class Fp8GemvConfig:
    """The FP8 GEMV's rows and tiles; every field can be overridden from
    benchmarks/bench_fp8_gemv.py --variants (the lead's sweep picks the defaults)."""
    # M up to this takes the GEMV (ops/fp8_linear.py), more rows the FP8 GEMMs; 0: never. One
    # row: at 2-16 rows the skinny GEMM with the input quantized per token reads the 8B
    # shape's weights at 1.18-1.54x their floor against the GEMV's 1.9-4.4x (H100), and a
    # decode step of 8 rows took 4.13 ms against 7.45 (docs/fp8.md, "Small-batch GEMV")
    max_rows: int = 1
    # the MMA kernel: rows of the weight a program, the K tile (cut into one slice a warp;
    # block weights: slices of the block's width whatever mma_block_k says), stages, warps,
    # slices of K (split-K; None: `mma_split`, enough programs for every SM)
    mma_block_n: int | None = None  # None: `mma_columns`
    mma_block_k: int | None = None  # None: `mma_tiles`
    mma_stages: int | None = None  # None: `mma_tiles`
    mma_warps: int = 4
    mma_split_k: int | None = None
    # rows are padded to a power of two, at least this (the dot's narrow side is 2 x that:
    # hi and lo; 8 pads every row count to one MMA width in the kernel itself)
    mma_min_m_pad: int = 1

    def mma_tiles(self, rows: int) -> tuple[int, int]:
        """(K tile, stages) of the MMA kernel at `rows` input rows. Defaults: 512-wide K tiles
        at one row, 256 above (the H100 sweep: the 8B layer's four one-row products 107 us
        against 114, its 4-row products faster at 256 or less); stages 3 for 256-wide tiles
        up to 8 rows, else 2 (3 spill registers at 16 rows)."""
        block_k = self.mma_block_k or (512 if rows == 1 else 256)
        return block_k, self.mma_stages or (3 if block_k <= 256 and rows <= 8 else 2)


# the defaults with SLIPSTREAM_FP8_GEMV_CONFIG's "field=value,..." changes (A/B runs in the
# engine, e.g. "mma_block_k=256" or "max_rows=8")
DEFAULT_FP8_GEMV_CONFIG = config_from_env(Fp8GemvConfig, "SLIPSTREAM_FP8_GEMV_CONFIG")


def fp8_gemv(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
             row_scale_eps: float | None = None, silu_mul: bool = False,
             cfg: Fp8GemvConfig = DEFAULT_FP8_GEMV_CONFIG) -> torch.Tensor:
    """x [..., K] (M rows, at most 16) @ W^T (+ bias) (+ residual [..., N]) into `out` (new if
    None; it may be `residual`). row_scale_eps and silu_mul as in `ops.triton_gemv.gemv`."""
    n, k = w.shape
    width = 2 * k if silu_mul else k
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.shape[-1] != width or not 0 < m <= 16:
        raise ValueError(f"fp8_gemv: 1 to 16 input rows of width {width} expected, got {tuple(x.shape)}")
    x2 = x.reshape(m, width)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    out2 = out.view(m, n)
    res2 = residual.view(m, n) if residual is not None else out2
    block_k, stages = cfg.mma_tiles(m)
    fp8_gemv_mma(x2, w, bias, res2, out2, has_res=residual is not None, row_scale_eps=row_scale_eps,
                 silu_mul=silu_mul, block_n=cfg.mma_block_n, block_k=block_k, stages=stages,
                 num_warps=cfg.mma_warps, split=cfg.mma_split_k, sms=sm_count(x.device),
                 min_m_pad=cfg.mma_min_m_pad)
    return out
