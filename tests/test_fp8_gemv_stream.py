"""The one-row FP8 stream GEMV (ops/triton_fp8_gemv_stream.py, `Fp8GemvConfig.one_row =
"stream"`) against the weight-only reference `fp8_linear_ref` in float32, under the bounds
of tests/test_fp8_gemv.py (|y - ref| <= the output's rounding |ref| + 2^-10 max |ref|): every
scale layout with every epilogue (bias, the folded norm's gamma and row scale, the residual
in place, SiLU·mul of [gate | up]), ragged K and N, and the extreme rows of
tests/test_fp8_gemv_range.py (1e-12 to 1e9, zeros), each held to its own size.

CPU: Triton's interpreter at tiny tiles (the L2 prefetch, inline PTX, is left out there);
the `gpu` tests run the 8B shape's products with the default tiles and prefetch, under a
CUDA graph; the compile test builds the launches for sm_90 without a GPU.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fp8_gemv import SHAPES_8B, _case, _close, _weight, _x
from test_fp8_gemv_range import ROUNDING, _close_rows, _extreme_rows, _gpu_weight

from slipstream.ops.fp8_linear import fp8_linear_ref
from slipstream.ops.fused import scale_rows_ref, silu_and_mul_ref
from slipstream.ops.triton_fp8_gemv import Fp8GemvConfig, fp8_gemv
from slipstream.ops.triton_fp8_gemv_stream import stream_columns, stream_shape
from slipstream.quant.fp8 import Fp8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# K slices of 32 columns, 2 warps: 64-column K tiles, so K = 160 is 2.5 tiles; N = 48 is 3
# programs of 16 rows
STREAM_TINY = Fp8GemvConfig(one_row="stream", stream_block_n=16, stream_tile_bytes=1024, stream_warps=2,
                            stream_stages=2)
LAYOUTS = ["tensor", "channel", "block"]


def _cfg(**kw) -> Fp8GemvConfig:
    return dataclasses.replace(STREAM_TINY, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("epilogue", ["bias", "norm", "residual", "silu_mul"])
def test_stream_kernel_one_row(layout, epilogue):
    y, ref, extra = _case(epilogue, 1, 48, 160, layout, STREAM_TINY)
    assert y.shape == (1, 48) and y.dtype == torch.bfloat16
    _close(y, ref, extra)


@pytest.mark.parametrize("n,k,block_n", [(40, 128, 32), (48, 96, 16), (16, 64, 16)])
def test_stream_kernel_ragged_and_even_shapes(n, k, block_n):
    """N not a multiple of the rows a program (40 at 32), K not a multiple of the tile (96 at
    64), and the unmasked loads where both divide (16 x 64: one tile, no loop trip)."""
    cfg = _cfg(stream_block_n=block_n)
    for epilogue in ("norm", "residual"):
        _close(*_case(epilogue, 1, n, k, "channel", cfg))


def test_stream_kernel_takes_one_row_only():
    """Two rows and more take the MMA kernel whatever one_row says (same results as it)."""
    w, x = _weight(48, 160, "channel", True), _x(3, 160)
    mma = Fp8GemvConfig(fma_rows=0, mma_block_n=16, mma_block_k=64, mma_warps=2, mma_stages=2)
    cfg = dataclasses.replace(mma, one_row="stream")
    assert torch.equal(fp8_gemv(x, w, row_scale_eps=1e-5, cfg=cfg), fp8_gemv(x, w, row_scale_eps=1e-5, cfg=mma))


def test_one_row_kernel_name_is_checked():
    with pytest.raises(ValueError, match="one of mma, stream"):
        Fp8GemvConfig(one_row="fast")


def test_config_from_the_environment():
    """SLIPSTREAM_FP8_GEMV_CONFIG changes integer fields of the defaults, and names a bad item."""
    from slipstream.ops.triton_fp8_gemv import config_from_env
    cfg = config_from_env("stream_prefetch_tiles=4, mma_prefetch_ahead=2,stream_block_n=None")
    assert (cfg.stream_prefetch_tiles, cfg.mma_prefetch_ahead, cfg.stream_block_n) == (4, 2, None)
    assert config_from_env("") == Fp8GemvConfig()
    with pytest.raises(ValueError, match="SLIPSTREAM_FP8_GEMV_CONFIG: 'stream_tiles=4' is not FIELD=INT"):
        config_from_env("stream_tiles=4")
    with pytest.raises(ValueError, match="one_row=stream"):
        config_from_env("one_row=stream")


@pytest.mark.subprocess
def test_the_engine_default_follows_the_environment():
    """SLIPSTREAM_FP8_GEMV and SLIPSTREAM_FP8_GEMV_CONFIG, read once at import, make the
    default config the engine's FP8 layers use (fp8_linear's GEMV path); a bad name fails."""
    import os
    import subprocess
    import sys
    code = ("from slipstream.ops.triton_fp8_gemv import DEFAULT_FP8_GEMV_CONFIG as c; "
            "print(c.one_row, c.stream_prefetch_tiles, c.mma_prefetch_ahead)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, SLIPSTREAM_FP8_GEMV="stream",
               SLIPSTREAM_FP8_GEMV_CONFIG="stream_prefetch_tiles=8,mma_prefetch_ahead=4")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["stream", "8", "4"], r.stderr[-2000:]
    env["SLIPSTREAM_FP8_GEMV"] = "fast"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "must be one of mma, stream, not 'fast'" in r.stderr


def test_a_triton_that_refuses_narrow_dots_gets_16_columns(monkeypatch):
    """Where Triton compiles no dot narrower than 16 columns, the first launch fails while
    compiling (nothing ran) and the dot's hi and lo are padded with zero columns from then
    on, with the same result."""
    import ast

    from triton.compiler.errors import CompilationError

    import slipstream.ops.triton_fp8_gemv_stream as ts
    kernel, widths = ts._fp8_gemv_stream_kernel, []

    class Strict:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                widths.append(kw["NB"])
                if kw["NB"] < 16:
                    raise CompilationError(None, ast.Pass(), "dot: 16 columns at least")
                kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ts, "_fp8_gemv_stream_kernel", Strict())
    monkeypatch.setattr(ts, "_NARROW", [2])
    w, x = _weight(48, 160, "channel", True), _x(1, 160)
    y = fp8_gemv(x, w, row_scale_eps=1e-5, cfg=STREAM_TINY)
    _close(y, scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-5, None))
    assert widths == [2, 16] and ts._NARROW == [16]
    fp8_gemv(x, w, cfg=STREAM_TINY)
    assert widths[-1] == 16  # no second failing try


def test_bad_prefetch_is_refused():
    w, x = _weight(48, 160, "channel", False), _x(1, 160)
    with pytest.raises(ValueError, match="prefetch_tiles must be 0 or a power of two, not 3"):
        fp8_gemv(x, w, cfg=_cfg(stream_prefetch_tiles=3))


def test_stream_tile_rules():
    """The most rows a program (32-128) that give every SM a program; 32 KB K tiles."""
    assert [stream_columns(n, 132) for n in (4096, 6144, 28672, 128256)] == [32, 32, 128, 128]
    assert stream_columns(4096, 132, least=16) == 16 and stream_columns(100, 132) == 32
    assert stream_columns(28672, 132, programs_per_sm=2) == 64
    sh = stream_shape(4096, 14336, None, 32768, 4, None, 132)
    assert (sh.block_n, sh.k_slice, sh.programs) == (32, 256, 128)
    assert stream_shape(28672, 4096, None, 32768, 4, None, 132).k_slice == 64
    assert stream_shape(64, 96, 16, 32768, 4, None, 132).k_slice == 128  # at most K's power of two
    assert stream_shape(6144, 4096, None, 32768, 4, (128, 128), 132).k_slice == 128  # a scale block


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_kernel_keeps_each_rows_range(layout):
    """Each extreme row alone (the engine's batch 1): O(1), 1e6 and -1e9 spikes, 1e-6, 1e-12,
    zeros; each K slice takes its own power of two."""
    w, x = _weight(48, 160, layout, False), _extreme_rows(160)
    for row in range(6):
        xi = x[row:row + 1]
        _close_rows(fp8_gemv(xi, w, cfg=STREAM_TINY), fp8_linear_ref(xi.float(), w))


def test_stream_kernel_slices_of_different_sizes_in_one_row():
    """A row whose K slices differ by 1e21 (1e-12 values, then O(1), then 1e9 spikes): each
    slice is split at its own scale, so the small slices keep their share to the bound."""
    w = _weight(48, 192, "channel", True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 192, generator=g)
    x[0, :64] *= 1e-12
    x[0, 128::7] = 1e9
    x = x.to(torch.bfloat16).to(DEVICE)
    ref = scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-30, None)
    _close_rows(fp8_gemv(x, w, row_scale_eps=1e-30, cfg=STREAM_TINY), ref)
    # the small slice alone, with the large ones zeroed: the same kernel, its own size
    x[0, 64:] = 0.0
    ref = scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-30, None)
    _close_rows(fp8_gemv(x, w, row_scale_eps=1e-30, cfg=STREAM_TINY), ref)


def test_stream_kernel_silu_mul_with_all_negative_gates():
    """down's input silu(gate) * up: each slice's scale comes from the values themselves (not
    the MMA kernel's bound), so a row whose every gate is -30 (silu ~ -3e-12) is held to its
    own size, beside the usual extreme rows."""
    w = _weight(48, 80, "channel", False)
    gate_up = _extreme_rows(160)
    gate_up[0, :80] = -30.0
    a = silu_and_mul_ref(gate_up).float()
    extra = ROUNDING * (a.abs() @ w.dequantized(torch.float32).abs().T)
    for row in range(6):
        r = torch.zeros(1, 48, dtype=torch.bfloat16, device=DEVICE)
        out = fp8_gemv(gate_up[row:row + 1], w, residual=r, out=r, silu_mul=True, cfg=STREAM_TINY)
        _close_rows(out, fp8_linear_ref(a[row:row + 1], w), extra[row:row + 1])


# --- the GPU: the 8B shape's products at the default tiles, with the L2 prefetch ---

STREAM = Fp8GemvConfig(fma_rows=0, one_row="stream")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("layout", ["channel", "block"])
def test_gpu_stream_gemv_at_8b_sizes(n, k, layout):
    for epilogue in ("bias", "norm", "residual", "silu_mul"):
        _close(*_case(epilogue, 1, n, k, layout, STREAM, block=(128, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["channel", "block"])
def test_gpu_stream_gemv_keeps_each_rows_range_at_8b_sizes(layout):
    """Every extreme row alone through qkv (folded norm), o (residual), gate_up and down
    (SiLU·mul), on the GPU's tensor cores."""
    x6 = _extreme_rows(4096)
    for n, k, gamma in [(6144, 4096, True), (4096, 4096, False), (28672, 4096, True)]:
        w = _gpu_weight(n, k, gamma, layout)
        for row in range(6):
            x = x6[row:row + 1]
            if gamma:
                ref = scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-30, None)
                _close_rows(fp8_gemv(x, w, row_scale_eps=1e-30, cfg=STREAM), ref)
            else:
                r = torch.zeros(1, n, dtype=torch.bfloat16, device=DEVICE)
                _close_rows(fp8_gemv(x, w, residual=r, out=r, cfg=STREAM), fp8_linear_ref(x.float(), w))
    w, gate_up = _gpu_weight(4096, 14336, False, layout), _extreme_rows(2 * 14336)
    a = silu_and_mul_ref(gate_up).float()
    extra = ROUNDING * (a.abs() @ w.dequantized(torch.float32).abs().T)
    for row in range(6):
        out = fp8_gemv(gate_up[row:row + 1], w, silu_mul=True, cfg=STREAM)
        _close_rows(out, fp8_linear_ref(a[row:row + 1], w), extra[row:row + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_gpu_stream_prefetch_and_tiles_change_no_bits(n, k):
    """The L2 prefetch only moves bytes earlier, and the stages only the pipeline: the same
    bits with prefetch off and 8 tiles ahead (4 by default), 2 and 4 stages (the same tiles)."""
    w = _weight(n, k, "channel", True)
    x = _x(1, k)
    base = fp8_gemv(x, w, row_scale_eps=1e-5, cfg=STREAM)
    for kw in ({"stream_prefetch_tiles": 0}, {"stream_prefetch_tiles": 8}, {"stream_stages": 2},
               {"stream_stages": 4}):
        assert torch.equal(fp8_gemv(x, w, row_scale_eps=1e-5, cfg=dataclasses.replace(STREAM, **kw)), base), kw


@pytest.mark.gpu
def test_gpu_stream_gemv_replays_in_a_cuda_graph():
    w = _weight(4096, 14336, "channel", False)
    gate_up = _x(1, 2 * 14336)
    r = _x(1, 4096, seed=4)
    graph_r = r.clone()
    fp8_gemv(gate_up, w, residual=graph_r.clone(), out=graph_r.clone(), silu_mul=True, cfg=STREAM)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_gemv(gate_up, w, residual=graph_r, out=graph_r, silu_mul=True, cfg=STREAM)
    for seed in (9, 10, 11):
        gate_up.copy_(_x(1, 2 * 14336, seed=seed))
        graph_r.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        eager = r.clone()
        fp8_gemv(gate_up, w, residual=eager, out=eager, silu_mul=True, cfg=STREAM)
        assert torch.equal(graph_r, eager)


# --- compiled for Hopper without a GPU ---

def compile_stream_for_hopper() -> int:
    """Compile the stream kernel for sm_90 as fp8_gemv launches it at the 8B shape (qkv with
    the folded norm, o into the residual, gate_up, down with SiLU·mul; qkv with 128 x 128
    blocks), the prefetch set as on a GPU (the CPU launch leaves it off). Returns the count."""
    from test_attention_kernels import compile_launch_for_hopper, recorded_launches

    import slipstream.ops.triton_fp8_gemv_stream as ts
    bf, f8 = torch.bfloat16, torch.float8_e4m3fn

    def weight(n, k, block=None, gamma=True):
        scale = torch.ones((n // 128, k // 128) if block else (n,))
        return Fp8Weight(torch.zeros(n, k, dtype=f8), scale, block, torch.ones(k) if gamma else None)

    launches: list = []
    with recorded_launches(ts, ["_fp8_gemv_stream_kernel"], launches):
        fp8_gemv(torch.zeros(1, 4096, dtype=bf), weight(6144, 4096), row_scale_eps=1e-5, cfg=STREAM)
        h = torch.zeros(1, 4096, dtype=bf)
        fp8_gemv(torch.zeros(1, 4096, dtype=bf), weight(4096, 4096, gamma=False), residual=h, out=h, cfg=STREAM)
        fp8_gemv(torch.zeros(1, 4096, dtype=bf), weight(28672, 4096), row_scale_eps=1e-5, cfg=STREAM)
        fp8_gemv(torch.zeros(1, 2 * 14336, dtype=bf), weight(4096, 14336, gamma=False), residual=h, out=h,
                 silu_mul=True, cfg=STREAM)
        fp8_gemv(torch.zeros(1, 4096, dtype=bf), weight(6144, 4096, (128, 128)), row_scale_eps=1e-5, cfg=STREAM)
    for fn, args, kw in launches:
        kw = dict(kw, PRE_TILES=STREAM.stream_prefetch_tiles)
        compiled, consts, _ = compile_launch_for_hopper(fn, args, kw)
        ptx = compiled.asm["ptx"]
        assert "mma.sync" in ptx, "the product is not on tensor cores"
        assert 0 <= ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"), "no prefetch before the wait"
        assert ptx.count("prefetch.global.L2") >= 2, "no prefetch in the loop"
        print("compiled", fn.__name__, consts["BLOCK_N"], consts["K_SLICE"], compiled.metadata.shared,
              compiled.n_regs if hasattr(compiled, "n_regs") else "")
    return len(launches)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU tests compile the kernels")
def test_fp8_gemv_stream_compiles_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    assert out.count("compiled") == 5, out


if __name__ == "__main__":
    import sys
    if "--compile-for-hopper" in sys.argv:
        compile_stream_for_hopper()
