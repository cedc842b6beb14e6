"""The small-batch FP8 GEMV (ops/triton_fp8_gemv.py: the MMA kernel at 1-16 rows,
ops/triton_fp8_gemv_mma.py; the engine sends it one row) against the weight-only reference
`fp8_linear_ref` in float32: every scale layout (per tensor, per channel, 128 x 128-style
blocks) with every epilogue (bias, the folded norm's gamma and row scale, the residual added
in place, SiLU·mul of [gate | up] as the input), split-K included.

Bound: the reference multiplies the float32 input by the dequantized weight in float32; the
kernels sum fp32 products in another order (the MMA kernel's input in two f16 parts, exact
for these inputs' bf16 values) and round once to bf16, so |y - ref| <= 2^-8 |ref| (the
rounding: half an ulp of bf16, 2^-8 relative at most; Triton's interpreter truncates its
bf16 casts, a whole ulp, 2^-7) + 2^-10 max |ref| (the summation order).

On the CPU the kernels run under Triton's interpreter at tiny sizes; the `gpu` tests run
them at the 8B shape's sizes and under a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from slipstream.ops.fp8_linear import fp8_linear_ref
from slipstream.ops.fused import scale_rows_ref, silu_and_mul_ref
from slipstream.ops.triton_fp8_gemv import Fp8GemvConfig, fp8_gemv
from slipstream.ops.triton_fp8_gemv_mma import mma_columns, mma_split
from slipstream.quant.fp8 import (
    Fp8Weight,
    quantize_blocks,
    quantize_per_channel,
    quantize_per_tensor,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tiny tiles for the interpreter: K = 160 is 2.5 K tiles of 64 (a partial last tile), N = 48
# is 3 row blocks of 16
MMA_TINY = Fp8GemvConfig(mma_block_n=16, mma_block_k=64, mma_warps=2, mma_stages=2)
LAYOUTS = ["tensor", "channel", "block"]


def _weight(n: int, k: int, layout: str, gamma: bool, seed: int = 0, block=(16, 32)) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    quant = {"tensor": quantize_per_tensor, "channel": quantize_per_channel,
             "block": lambda t: quantize_blocks(t, block)}[layout]
    q, s = quant(w)
    gm = (torch.rand(k, generator=g) + 0.5).to(DEVICE) if gamma else None
    return Fp8Weight(q.to(DEVICE), s.to(DEVICE), block if layout == "block" else None, gm)


def _x(m: int, k: int, seed: int = 1, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).to(torch.bfloat16).to(DEVICE)


ROUNDING = 2 ** -8 if DEVICE == "cuda" else 2 ** -7


def _close(y: torch.Tensor, ref: torch.Tensor, extra: torch.Tensor | float = 0.0) -> None:
    err = (y.float() - ref).abs()
    bound = ref.abs() * ROUNDING + ref.abs().max() * 2 ** -10 + extra
    worst = (err - bound).max().item()
    assert worst <= 0, f"max error {err.max().item():.3g} over the bound by {worst:.3g}"


def _case(epilogue: str, m: int, n: int, k: int, layout: str, cfg: Fp8GemvConfig, block=(16, 32)):
    """(kernel output, reference, extra error bound) of one epilogue at m rows (`block`: the
    block layout's)."""
    if epilogue == "bias":
        w, x, b = _weight(n, k, layout, False, block=block), _x(m, k), _x(1, n, seed=2)[0]
        return fp8_gemv(x, w, b, cfg=cfg), fp8_linear_ref(x.float(), w, b.float()), 0.0
    if epilogue == "norm":  # gamma and the row scale (qkv, gate_up); x far from unit RMS
        w, x = _weight(n, k, layout, True, block=block), _x(m, k, scale=7.0)
        ref = scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-5, None)
        return fp8_gemv(x, w, row_scale_eps=1e-5, cfg=cfg), ref, 0.0
    r = _x(m, n, seed=4)
    expect, extra = r.float(), 0.0
    if epilogue == "residual":  # o: out += x W^T in place
        w, x = _weight(n, k, layout, False, block=block), _x(m, k)
        expect = expect + fp8_linear_ref(x.float(), w)
        out = fp8_gemv(x, w, residual=r, out=r, cfg=cfg)
    else:  # down: out += silu(gate) * up W^T in place
        w, gate_up = _weight(n, k, layout, False, block=block), _x(m, 2 * k, seed=3)
        a = silu_and_mul_ref(gate_up).float()
        expect = expect + fp8_linear_ref(a, w)
        out = fp8_gemv(gate_up, w, residual=r, out=r, silu_mul=True, cfg=cfg)
        # the input is rounded to bf16 in both, from sigmoids computed apart: an ulp of each
        # value apart at most (ROUNDING), times its weights
        extra = ROUNDING * (a.abs() @ w.dequantized(torch.float32).abs().T)
    assert out.data_ptr() == r.data_ptr()
    return r, expect, extra


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("epilogue", ["bias", "norm", "residual", "silu_mul"])
@pytest.mark.parametrize("m,split", [(1, 1), (5, 3), (16, 2)])
def test_mma_kernel_rows_and_split_k(layout, epilogue, m, split):
    """1, 5 and 16 rows (8 and 16 padded MMA columns), K cut in 1, 2 or 3 slices."""
    cfg = Fp8GemvConfig(**{**MMA_TINY.__dict__, "mma_split_k": split})
    y, ref, extra = _case(epilogue, m, 48, 160, layout, cfg)
    assert y.shape == (m, 48) and y.dtype == torch.bfloat16
    _close(y, ref, extra)


def test_mma_split_k_is_deterministic_and_resets_its_tickets():
    """The last program of a row block adds the slices in their order: two launches give the
    same bits, and every ticket is back at zero for the next launch (a CUDA graph replays it)."""
    from slipstream.ops.tickets import tickets
    w, x = _weight(48, 160, "channel", True), _x(3, 160)
    cfg = Fp8GemvConfig(**{**MMA_TINY.__dict__, "mma_split_k": 3})
    first = fp8_gemv(x, w, row_scale_eps=1e-6, cfg=cfg)
    assert torch.equal(fp8_gemv(x, w, row_scale_eps=1e-6, cfg=cfg), first)
    left = tickets(x.device, 3)
    assert left.numel() >= 3 and int(left.abs().sum()) == 0


def test_a_triton_that_refuses_narrow_dots_gets_rows_padded_to_8(monkeypatch):
    """Where Triton compiles no dot narrower than 16 columns, the first such launch fails while
    compiling (nothing ran) and the rows are padded to 8 from then on, with the same result."""
    import ast

    from triton.compiler.errors import CompilationError

    import slipstream.ops.triton_fp8_gemv_mma as tm
    launch, pads = tm._launch, []

    def strict(*args):
        pads.append(args[5])
        if args[5] < 8:
            raise CompilationError(None, ast.Pass(), "dot: 16 columns at least")
        launch(*args)

    monkeypatch.setattr(tm, "_launch", strict)
    monkeypatch.setattr(tm, "_NARROW_FLOOR", [1])
    w, x = _weight(48, 160, "channel", True), _x(3, 160)
    y = fp8_gemv(x, w, row_scale_eps=1e-5, cfg=MMA_TINY)
    _close(y, scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-5, None))
    assert pads == [4, 8] and tm._NARROW_FLOOR == [8]
    fp8_gemv(x[:1], w, cfg=MMA_TINY)
    assert pads[-1] == 8  # no second failing try


def test_rows_outside_1_to_16_are_refused():
    w = _weight(48, 160, "channel", False)
    with pytest.raises(ValueError, match="1 to 16 input rows"):
        fp8_gemv(_x(17, 160), w)
    with pytest.raises(ValueError, match="width 160"):
        fp8_gemv(_x(1, 96), w)


def test_tile_rules():
    """128 weight rows a program, fewer for small weights; split-K fills the SMs (the 8B
    shape's o at 128 rows: 32 row blocks, 8 slices on 132 SMs)."""
    assert mma_columns(28672) == 128 and mma_columns(40) == 64 and mma_columns(20) == 32
    assert mma_split(32, 16, 132) == 8 and mma_split(224, 16, 132) == 1 and mma_split(48, 2, 132) == 2


# --- the GPU: the 8B shape's sizes, both kernels, graphs ---

SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


GPU_KERNELS = {"mma": Fp8GemvConfig(), "mma-pad8": Fp8GemvConfig(mma_min_m_pad=8)}


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("kernel,m", [("mma", 1), ("mma-pad8", 1), ("mma", 2), ("mma", 5), ("mma", 8),
                                      ("mma", 16)])
def test_gpu_gemv_at_8b_sizes(n, k, layout, kernel, m):
    """Each form the model runs, split-K where the shape has
    few row blocks (qkv, o, down)."""
    cfg = GPU_KERNELS[kernel]
    for epilogue in ("norm", "residual", "silu_mul"):
        _close(*_case(epilogue, m, n, k, layout, cfg, block=(128, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_gemv_replays_in_a_cuda_graph(m):
    """Split-K's tickets and workspace under a graph: replays on new inputs equal eager."""
    w = _weight(4096, 4096, "channel", True)
    cfg = Fp8GemvConfig()  # the o shape: split-K
    x = _x(m, 4096)
    out = torch.empty((m, 4096), dtype=torch.bfloat16, device=DEVICE)
    for _ in range(2):
        fp8_gemv(x, w, out=out, row_scale_eps=1e-5, cfg=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_gemv(x, w, out=out, row_scale_eps=1e-5, cfg=cfg)
    for seed in (9, 10, 11):
        x.copy_(_x(m, 4096, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_gemv(x, w, row_scale_eps=1e-5, cfg=cfg))


# --- compiled for Hopper without a GPU (the interpreter misses what only the compiler rejects) ---

def compile_gemv_for_hopper() -> int:
    """Compile the MMA kernel for sm_90 as fp8_gemv launches it at the 8B shape: qkv with the
    folded norm at 1 row, o into the residual at 4 rows (split-K), gate_up at 16 rows, down
    with SiLU·mul at 8 rows (split-K), 128 x 128 block weights at 2 rows, and o at one row.
    Returns the number of launches compiled."""
    from test_attention_kernels import compile_launch_for_hopper, recorded_launches

    import slipstream.ops.triton_fp8_gemv_mma as tm
    bf, f8 = torch.bfloat16, torch.float8_e4m3fn
    mma = Fp8GemvConfig()

    def weight(n, k, block=None, gamma=True):
        scale = torch.ones((n // 128, k // 128) if block else (n,))
        return Fp8Weight(torch.zeros(n, k, dtype=f8), scale, block, torch.ones(k) if gamma else None)

    launches: list = []
    with recorded_launches(tm, ["_fp8_gemv_mma_kernel"], launches):
        fp8_gemv(torch.zeros(1, 4096, dtype=bf), weight(6144, 4096), row_scale_eps=1e-5, cfg=mma)
        h4 = torch.zeros(4, 4096, dtype=bf)
        fp8_gemv(torch.zeros(4, 4096, dtype=bf), weight(4096, 4096, gamma=False), residual=h4, out=h4, cfg=mma)
        fp8_gemv(torch.zeros(16, 4096, dtype=bf), weight(28672, 4096), row_scale_eps=1e-5, cfg=mma)
        h8 = torch.zeros(8, 4096, dtype=bf)
        fp8_gemv(torch.zeros(8, 2 * 14336, dtype=bf), weight(4096, 14336, gamma=False), residual=h8, out=h8,
                 silu_mul=True, cfg=mma)
        fp8_gemv(torch.zeros(2, 4096, dtype=bf), weight(6144, 4096, (128, 128)), row_scale_eps=1e-5, cfg=mma)
        fp8_gemv(torch.zeros(1, 4096, dtype=bf), weight(4096, 4096, gamma=False), cfg=mma)
    for fn, args, kw in launches:
        compiled, consts, _ = compile_launch_for_hopper(fn, args, kw)
        assert "mma.sync" in compiled.asm["ptx"], "the product is not on tensor cores"
        print("compiled", fn.__name__, consts["SPLIT"], consts["M_PAD"])
    return len(launches)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU tests compile the kernels")
def test_fp8_gemv_compiles_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    assert out.count("compiled") == 6, out


if __name__ == "__main__":
    import sys
    if "--compile-for-hopper" in sys.argv:
        compile_gemv_for_hopper()
