"""The tensor-core GEMV for bf16 / f16 weights at 2-16 rows (`ops.triton_gemv.gemv` routes them
to `gemv_mma`, the FP8 GEMV's kernel with the weight in its own dtype) against F.linear in
float32 of the same inputs: the bias, the residual added in place (`linear_add_`), an output
given (`linear_into_`), the folded norm's row scale, SiLU·mul of [gate | up] as the input, split-K;
and which products take it.

Bound: bf16 x bf16 products are exact in the fp32 accumulator, so the kernel differs from the
reference by its summation order (2^-10 max |ref|) and its one rounding to the output dtype
(half an ulp, 2^-8 relative for bf16; Triton's interpreter truncates its bf16 casts: 2^-7).

On the CPU the kernel runs under Triton's interpreter at tiny sizes (N and K not multiples of
the tiles); the `gpu` tests run it at the 8B shape's sizes, through the linear layers and under
a CUDA graph.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from slipstream.ops.fused import scale_rows_ref, silu_and_mul_ref
from slipstream.ops.triton_gemv import GemvConfig, gemv, gemv_applies, native_mma_shape, takes_mma

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tiny tiles for the interpreter: K = 200 is 3 K tiles of 64 and a partial one, N = 37 is 2
# full row blocks of 16 and a ragged one
TINY = GemvConfig(max_rows_mma=16, mma_block_n=16, mma_block_k=64, mma_warps=2, mma_stages=2)
N, K = 37, 200


def _rounding(dtype: torch.dtype) -> float:
    if dtype == torch.float16:
        return 2 ** -11
    return 2 ** -8 if DEVICE == "cuda" else 2 ** -7


def _t(*shape, dtype, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, extra: torch.Tensor | float = 0.0) -> None:
    err = (y.float() - ref).abs()
    bound = ref.abs() * _rounding(dtype) + ref.abs().max() * 2 ** -10 + extra
    worst = (err - bound).max().item()
    assert worst <= 0, f"max error {err.max().item():.3g} over the bound by {worst:.3g}"


def _case(epilogue: str, m: int, n: int, k: int, dtype: torch.dtype, cfg: GemvConfig):
    """(kernel output, float32 reference, extra bound) of one epilogue at m rows."""
    w = _t(n, k, dtype=dtype, seed=0, scale=k ** -0.5)
    if epilogue == "plain":
        x = _t(m, k, dtype=dtype, seed=1, scale=3.0)
        return gemv(x, w, cfg=cfg), F.linear(x.float(), w.float()), 0.0
    if epilogue == "bias":
        x, b = _t(m, k, dtype=dtype, seed=1, scale=3.0), _t(n, dtype=dtype, seed=2)
        return gemv(x, w, b, cfg=cfg), F.linear(x.float(), w.float(), b.float()), 0.0
    if epilogue == "norm":  # qkv / gate_up with the folded norm: rstd(x) * x W^T + b
        x, b = _t(m, k, dtype=dtype, seed=1, scale=7.0), _t(n, dtype=dtype, seed=2)
        ref = scale_rows_ref(F.linear(x.float(), w.float()), x.float(), 1e-5, b.float())
        return gemv(x, w, b, row_scale_eps=1e-5, cfg=cfg), ref, 0.0
    if epilogue == "into":  # linear_into_: a given output, every value overwritten
        x = _t(m, k, dtype=dtype, seed=1, scale=3.0)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        y = gemv(x, w, out=out, cfg=cfg)
        assert y.data_ptr() == out.data_ptr()
        return out, F.linear(x.float(), w.float()), 0.0
    r = _t(m, n, dtype=dtype, seed=4)
    expect, extra = r.float(), 0.0
    if epilogue == "residual":  # o: out += x W^T (+ b) in place, rounded once
        x, b = _t(m, k, dtype=dtype, seed=1, scale=3.0), _t(n, dtype=dtype, seed=2)
        expect = expect + F.linear(x.float(), w.float(), b.float())
        out = gemv(x, w, b, residual=r, out=r, cfg=cfg)
    else:  # down: out += silu(gate) * up W^T in place
        gate_up = _t(m, 2 * k, dtype=dtype, seed=3, scale=2.0)
        a = silu_and_mul_ref(gate_up).float()
        expect = expect + F.linear(a, w.float())
        out = gemv(gate_up, w, residual=r, out=r, silu_mul=True, cfg=cfg)
        # the input is rounded to the dtype in both, from sigmoids computed apart: an ulp of
        # each value apart at most, times its weights
        extra = 2 * _rounding(dtype) * (a.abs() @ w.float().abs().T)
    assert out.data_ptr() == r.data_ptr()
    return r, expect, extra


EPILOGUES = ["plain", "bias", "norm", "into", "residual", "silu_mul"]


@pytest.mark.quick_sample(3)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("m", [2, 3, 5, 8, 16])
def test_rows_and_epilogues_match_f_linear(epilogue, m):
    """2..16 rows (padded to 2, 4, 8 and 16 MMA columns), every form the layers take."""
    y, ref, extra = _case(epilogue, m, N, K, torch.bfloat16, TINY)
    assert y.shape == (m, N) and y.dtype == torch.bfloat16
    _close(y, ref, torch.bfloat16, extra)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("epilogue", ["norm", "residual", "silu_mul"])
def test_split_k_matches_f_linear(split, epilogue):
    """K in 1, 2 or 4 slices (the last program of a row block adds them), with the epilogues
    that need every slice first: the row scale (sum of x^2 over all of K) and the residual."""
    cfg = dataclasses.replace(TINY, mma_split_k=split)
    y, ref, extra = _case(epilogue, 3, N, K, torch.bfloat16, cfg)
    _close(y, ref, torch.bfloat16, extra)


@pytest.mark.parametrize("epilogue", ["bias", "residual"])
def test_f16_weights(epilogue):
    y, ref, extra = _case(epilogue, 4, N, K, torch.float16, dataclasses.replace(TINY, mma_split_k=2))
    assert y.dtype == torch.float16
    _close(y, ref, torch.float16, extra)


def test_strided_input_and_leading_dims():
    """x [2, 3, K] taken from a wider tensor (a row stride that is not K)."""
    wide = _t(6, K + 24, dtype=torch.bfloat16, seed=5)
    x = wide[:, 8:8 + K].reshape(2, 3, K)
    w = _t(N, K, dtype=torch.bfloat16, seed=0, scale=K ** -0.5)
    y = gemv(x, w, cfg=TINY)
    assert y.shape == (2, 3, N)
    _close(y.reshape(6, N), F.linear(x.reshape(6, K).float(), w.float()), torch.bfloat16)


def test_split_k_is_deterministic_and_resets_its_tickets():
    """Two launches give the same bits, and every ticket is back at zero for the next launch
    (a CUDA graph replays it)."""
    import slipstream.ops.triton_fp8_gemv_mma as tm
    cfg = dataclasses.replace(TINY, mma_split_k=4)
    x, w = _t(5, K, dtype=torch.bfloat16, seed=1), _t(N, K, dtype=torch.bfloat16, seed=0, scale=K ** -0.5)
    first = gemv(x, w, row_scale_eps=1e-6, cfg=cfg)
    assert torch.equal(gemv(x, w, row_scale_eps=1e-6, cfg=cfg), first)
    tickets = tm._WORKSPACES[tm.workspace_key(x.device)].tickets
    assert tickets.numel() >= 3 and int(tickets.abs().sum()) == 0


def test_which_products_take_it():
    bf, w = torch.bfloat16, torch.empty(1024, 1024, dtype=torch.bfloat16)
    cfg = GemvConfig(max_rows_mma=8)
    assert not takes_mma(1, bf, w, cfg)  # one row keeps the streaming kernels
    assert takes_mma(2, bf, w, cfg) and takes_mma(8, bf, w, cfg) and not takes_mma(9, bf, w, cfg)
    assert gemv_applies(torch.empty(5, 1024, dtype=bf), w, cfg)
    assert gemv_applies(torch.empty(2, 3, 1024, dtype=bf), w, cfg)  # 6 rows in leading dims
    assert not takes_mma(4, torch.float32, w, cfg)  # the input's dtype must be the weight's
    assert not takes_mma(4, torch.float32, w.float(), cfg)  # float32: cuBLAS
    assert not takes_mma(4, bf, torch.empty(1024, 1024, dtype=bf).t(), cfg)  # not row-major
    off = GemvConfig(max_rows_mma=0)
    assert not takes_mma(2, bf, w, off) and not gemv_applies(torch.empty(2, 1024, dtype=bf), w, off)
    assert takes_mma(16, torch.float16, w.half(), GemvConfig(max_rows_mma=16))


def test_the_environment_sets_the_row_limit(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_GEMV_MMA_ROWS", "0")
    assert GemvConfig().max_rows_mma == 0
    monkeypatch.setenv("SLIPSTREAM_GEMV_MMA_ROWS", "16")
    assert GemvConfig().max_rows_mma == 16
    for bad in ("17", "-1", "eight"):
        monkeypatch.setenv("SLIPSTREAM_GEMV_MMA_ROWS", bad)
        with pytest.raises(ValueError, match="SLIPSTREAM_GEMV_MMA_ROWS must be an integer from 0 to 16"):
            GemvConfig()
    with pytest.raises(ValueError, match="max_rows_mma must be 0..16"):
        GemvConfig(max_rows_mma=32)


def test_tiles_fill_the_sms():
    """128 weight rows a program where 8 slices of K give every SM a program, fewer where
    not; split-K the fewest slices that fill the SMs (132 SMs, the default tiles)."""
    shapes = {  # (n, k) -> (block_n, split)
        (6144, 4096): (128, 4),  # 8B qkv: 48 row blocks
        (4096, 4096): (128, 8),  # 8B o: 32 row blocks
        (28672, 4096): (128, 1),  # 8B gate_up: 224 row blocks
        (4096, 14336): (128, 8),  # 8B down
        (128256, 4096): (128, 1),  # 8B lm_head
        (1024, 2048): (32, 8),  # 0.6B o: 32 row blocks of 32
        (1024, 3072): (32, 8),  # 0.6B down
        (6144, 1024): (128, 4),  # 0.6B gate_up
    }
    got = {nk: (s.block_n, s.split) for nk in shapes for s in [native_mma_shape(*nk, 132)]}
    assert got == shapes


# --- the GPU: the 8B shape's sizes, the linear layers, graphs ---

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES_8B))
@pytest.mark.parametrize("m", [2, 3, 5, 8, 16])
def test_gpu_8b_shapes(name, m):
    """Every epilogue the layer takes at its 8B shape (split-K on qkv, o and down), with the
    default tiles (16 rows: max_rows_mma 16)."""
    n, k = SHAPES_8B[name]
    cfg = GemvConfig(max_rows_mma=16)
    for epilogue in ("bias", "norm", "residual", "silu_mul", "into"):
        y, ref, extra = _case(epilogue, m, n, k, torch.bfloat16, cfg)
        _close(y, ref, torch.bfloat16, extra)


@pytest.mark.gpu
def test_gpu_lm_head_at_verify_rows():
    """The 8B LM head (128,256 x 4,096, 1 GB) at the verify step's k + 1 rows."""
    cfg = GemvConfig(max_rows_mma=16)
    for m in (2, 5):
        _close(*_case("plain", m, 128256, 4096, torch.bfloat16, cfg), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_linear_layers_route_2_to_8_rows():
    """linear, linear_add_, linear_into_, norm_linear (finished inside the product) and
    silu_mul_linear_add_ at 2-8 rows take the tensor-core GEMV (as far as
    SLIPSTREAM_GEMV_MMA_ROWS lets them) and match the references; more rows and the
    batch-invariant mode keep their paths."""
    from slipstream.ops import linear as L
    from slipstream.ops.triton_gemv import DEFAULT_GEMV_CONFIG
    limit = DEFAULT_GEMV_CONFIG.max_rows_mma
    n, k = 4096, 4096
    w, b = _t(n, k, dtype=torch.bfloat16, seed=0, scale=k ** -0.5), _t(n, dtype=torch.bfloat16, seed=2)
    L.reserve_linear_workspace(w)
    for m in (2, 5, 8):
        x = _t(m, k, dtype=torch.bfloat16, seed=1, scale=3.0)
        _close(L.linear(x, w, b), F.linear(x.float(), w.float(), b.float()), torch.bfloat16)
        r = _t(m, n, dtype=torch.bfloat16, seed=4)
        expect = r.float() + F.linear(x.float(), w.float(), b.float())
        L.linear_add_(r, x, w, b)
        _close(r, expect, torch.bfloat16)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        L.linear_into_(out, x, w)
        _close(out, F.linear(x.float(), w.float()), torch.bfloat16)
        y, finished = L.norm_linear(x, w, b, 1e-5)
        assert finished == (m <= limit)
        if not finished:
            y = scale_rows_ref(y, x, 1e-5, b)
        _close(y, scale_rows_ref(F.linear(x.float(), w.float()), x.float(), 1e-5, b.float()), torch.bfloat16)
        gate_up = _t(m, 2 * k, dtype=torch.bfloat16, seed=3, scale=2.0)
        r = _t(m, n, dtype=torch.bfloat16, seed=4)
        a = silu_and_mul_ref(gate_up).float()
        expect = r.float() + F.linear(a, w.float())
        L.silu_mul_linear_add_(r, gate_up, w)
        _close(r, expect, torch.bfloat16, 2 * _rounding(torch.bfloat16) * (a.abs() @ w.float().abs().T))
    past = _t(limit + 1, k, dtype=torch.bfloat16, seed=1)
    assert not L._small_batch(past, w) and not L.norm_linear(past, w, b, 1e-5)[1]
    assert not L.norm_linear(past[:4], w, b, 1e-5, batch_invariant=True)[1]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 4, 8])
def test_gpu_replays_in_a_cuda_graph(m):
    """Split-K's tickets and workspace under a graph (the o shape, 8 slices): replays on new
    inputs equal eager, bit for bit, with the workspace reserved before the capture."""
    from slipstream.ops.triton_gemv import reserve_gemv_mma
    n, k = 4096, 4096
    cfg = GemvConfig(max_rows_mma=16)
    w = _t(n, k, dtype=torch.bfloat16, seed=0, scale=k ** -0.5)
    reserve_gemv_mma(w, cfg)
    x, h = _t(m, k, dtype=torch.bfloat16, seed=1), torch.zeros(m, n, dtype=torch.bfloat16, device=DEVICE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no eager warm-up: the capture itself compiles and launches
        gemv(x, w, residual=h, out=h, cfg=cfg)
    for seed in (9, 10, 11):
        x.copy_(_t(m, k, dtype=torch.bfloat16, seed=seed))
        start = _t(m, n, dtype=torch.bfloat16, seed=seed + 100)
        h.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        eager = start.clone()
        gemv(x, w, residual=eager, out=eager, cfg=cfg)
        assert torch.equal(h, eager)


# --- compiled for Hopper without a GPU (the interpreter misses what only the compiler rejects) ---

def compile_gemv_mma_for_hopper() -> int:
    """Compile the kernel for sm_90 as `gemv` launches it at the 8B shape: qkv with the folded
    norm and bias at 2 rows, o into the residual at 4 rows (split-K), gate_up at 8 rows, down
    with SiLU·mul at 16 rows (split-K), the lm_head at 5 rows; print each one's registers,
    spills and shared memory. Returns the number of launches compiled."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from kernel_resources import resources
    from test_attention_kernels import compile_launch_for_hopper, recorded_launches

    import slipstream.ops.triton_fp8_gemv_mma as tm
    bf = torch.bfloat16
    cfg = GemvConfig(max_rows_mma=16)

    def z(*shape):
        return torch.zeros(*shape, dtype=bf)

    launches: list = []
    with recorded_launches(tm, ["_gemv_mma_kernel"], launches):
        gemv(z(2, 4096), z(6144, 4096), z(6144), row_scale_eps=1e-5, cfg=cfg)
        h4 = z(4, 4096)
        gemv(z(4, 4096), z(4096, 4096), residual=h4, out=h4, cfg=cfg)
        gemv(z(8, 4096), z(28672, 4096), row_scale_eps=1e-5, cfg=cfg)
        h16 = z(16, 4096)
        gemv(z(16, 2 * 14336), z(4096, 14336), residual=h16, out=h16, silu_mul=True, cfg=cfg)
        gemv(z(5, 4096), z(128256, 4096), cfg=cfg)
    for fn, args, kw in launches:
        compiled, consts, _ = compile_launch_for_hopper(fn, args, kw)
        assert "mma.sync" in compiled.asm["ptx"] or "wgmma" in compiled.asm["ptx"], "not on tensor cores"
        res = resources(compiled.asm["cubin"])
        print("compiled", fn.__name__, f"M_PAD={consts['M_PAD']} BLOCK_N={consts['BLOCK_N']} "
              f"SPLIT={consts['SPLIT']} STAGES={consts['STAGES']} regs={res['regs']} local={res['local']} "
              f"shared={compiled.metadata.shared}")
    return len(launches)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU tests compile the kernels")
def test_gemv_mma_compiles_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    assert out.count("compiled") == 5, out


if __name__ == "__main__":
    import sys
    if "--compile-for-hopper" in sys.argv:
        compile_gemv_mma_for_hopper()
