"""FP8 products at 2-256 rows and in prefill: the skinny Triton GEMM
(ops/triton_fp8_gemm_skinny.py) against the activation-quantized reference, the row-count
routing table (ops/fp8_dispatch.py) and each kernel it routes to, fast accumulation's error.

On the CPU the Triton kernels run under Triton's interpreter (tests/conftest.py) at tiny
sizes, and the skinny GEMM is compiled for sm_90 without a GPU; the `gpu` tests run every
kernel at the 8B shape's sizes and under a CUDA graph.
"""
from __future__ import annotations

import functools

import pytest
import torch
from helpers import rel_rms
from test_fp8_kernels import _weight as fp8_kernels_weight

from slipstream.ops.fp8_dispatch import (ANY_ROWS, DISPATCH, Fp8Dispatch, Fp8Route, fp8_product,
                                         parse_dispatch)
from slipstream.ops.fp8_linear import fp8_linear_add_, fp8_linear_ref
from slipstream.ops.triton_fp8_gemm import Fp8GemmConfig, fp8_gemm, parse_tile_name
from slipstream.ops.triton_fp8_gemm_skinny import Fp8SkinnyConfig, fp8_gemm_skinny, skinny_config_for
from slipstream.quant.fp8 import Fp8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# test_fp8_kernels' random FP8 weight, cached: the GPU tests reuse the 8B shape's weights (read-only)
_weight = functools.lru_cache(maxsize=4)(fp8_kernels_weight)


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[:, ::29] *= 20  # outlier channels, as real activations have
    return x.to(torch.bfloat16).to(DEVICE)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 output rounding (2^-8 relative) plus fp32 summation-order differences."""
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2 * ref.abs().max().item() / 8, rtol=1e-2)


TINY = dict(block_n=16, block_m=16, block_k=32)


@pytest.mark.parametrize("block", [None, (16, 32)])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 3, 19, 40])
def test_skinny_matches_the_activation_quantized_reference(block, split_k, m):
    """K = 160: 5 K-steps of 32, split 1, 2 (3 + 2 steps) or 3 ways (2 + 2 + 1); 48 weight rows
    in 3 tiles; rows in one to three tiles, the last one partial."""
    w = _weight(48, 160, block, True)
    x, b = _x(m, 160), _x(1, 48, seed=2)[0]
    ref = fp8_linear_ref(x.float(), w, b.float(), quantize_input=True)
    y = fp8_gemm_skinny(x, w, b, Fp8SkinnyConfig(**TINY, split_k=split_k))
    assert y.shape == (m, 48) and y.dtype == torch.bfloat16
    _close(y, ref)


@pytest.mark.parametrize("split_k", [1, 2])
def test_skinny_adds_the_residual_in_place_rounded_once(split_k):
    w = _weight(48, 96, (16, 32), False)
    x, r = _x(21, 96), _x(21, 48, seed=6)
    expect = (r.float() + fp8_linear_ref(x.float(), w, quantize_input=True)).to(r.dtype)
    out = fp8_gemm_skinny(x, w, None, Fp8SkinnyConfig(**TINY, split_k=split_k), residual=r, out=r)
    assert out.data_ptr() == r.data_ptr()
    _close(r, expect)


def test_skinny_split_leaves_its_counters_at_zero():
    """The last split of a tile puts its counter back (ops/tickets.py: no memset before a
    launch), so a second launch, as a CUDA graph's replay would, gives the same bits."""
    from slipstream.ops.tickets import tickets
    w, x = _weight(48, 160, None, True), _x(21, 160)
    cfg = Fp8SkinnyConfig(**TINY, split_k=3)
    first = fp8_gemm_skinny(x, w, None, cfg)
    left = tickets(x.device, 1)
    assert int(left.abs().sum()) == 0
    assert torch.equal(fp8_gemm_skinny(x, w, None, cfg), first)
    assert int(tickets(x.device, 1).abs().sum()) == 0


def test_skinny_without_a_split_sums_as_the_gemm():
    """One split and the same K step: the same fp32 sums in the same order as the 64-row GEMM,
    so the same bits (the swap of operands changes no product)."""
    w = _weight(48, 160, None, True)
    x = _x(19, 160)
    a = fp8_gemm_skinny(x, w, None, Fp8SkinnyConfig(**TINY))
    b = fp8_gemm(x, w, None, Fp8GemmConfig(block_m=16, block_n=16, block_k=32))
    assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("block", [None, (16, 32)])
def test_persistent_gemm_has_the_same_bits(block):
    """A program walking several tiles (4 programs, 12 tiles under the interpreter) sums each
    as one program a tile does: the same bits, so batch invariance holds for either."""
    w = _weight(48, 96, block, True)
    x = _x(37, 96)
    tiles = dict(block_m=16, block_n=16, block_k=32)
    a = fp8_gemm(x, w, None, Fp8GemmConfig(**tiles))
    b = fp8_gemm(x, w, None, Fp8GemmConfig(**tiles, persistent=True))
    assert torch.equal(a, b)


def test_tile_names_route_to_the_triton_gemm_with_that_tile():
    cfg = Fp8GemmConfig(block_m=16, block_n=32, num_warps=2, num_stages=2, persistent=True)
    assert cfg.name == "tb-m16n32w2s2p" and parse_tile_name(cfg.name) == cfg
    assert parse_tile_name("triton") is None and parse_tile_name("tb-m16n32") is None
    d = parse_dispatch("block=skinny:8,tb-m16n32w2s2p")
    assert d.kernel_for(9, True) == "tb-m16n32w2s2p"
    w = _weight(48, 96, (16, 32), False)
    x, r = _x(9, 96), _x(9, 48, seed=6)
    expect = r.float() + fp8_linear_ref(x.float(), w, quantize_input=True)
    assert fp8_product(x, w, None, d.kernel_for(9, True), residual=r, out=r) is r
    _close(r, expect)


def test_skinny_config_follows_rows_and_splits_narrow_weights():
    assert skinny_config_for(17, 28672, 4096).block_m == 32
    assert skinny_config_for(8, 28672, 4096).block_m == 16
    assert skinny_config_for(256, 28672, 4096).block_m == 64
    assert skinny_config_for(32, 28672, 4096).split_k == 1  # 448 programs
    assert skinny_config_for(32, 6144, 4096).split_k == 2  # 96 programs for 132 SMs
    assert skinny_config_for(32, 4096, 14336).split_k == 3  # 64
    assert skinny_config_for(32, 1024, 2048).split_k == 4  # 16 (the 0.6B's o): at most 4 ways
    assert skinny_config_for(32, 4096, 1024).split_k == 2  # 64, K allows 2 splits of 512
    assert skinny_config_for(256, 4096, 4096).split_k == 1  # 4 row tiles: 256 programs


def test_skinny_stages_drop_one_only_where_that_avoids_a_second_wave():
    # gate_up at 17-32 rows: 448 programs of 12 KB stages, 3 an SM at 5 stages (396), 4 at 4
    assert skinny_config_for(17, 28672, 4096).num_stages == 4
    assert skinny_config_for(32, 28672, 4096).num_stages == 4
    # 16 rows (10 KB stages): 4 an SM at 5 stages already hold 448; 64 rows: 4 stages hold 396
    assert skinny_config_for(16, 28672, 4096).num_stages == 5
    assert skinny_config_for(64, 28672, 4096).num_stages == 5
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):  # 192 programs: one wave at 5
        assert skinny_config_for(32, n, k).num_stages == 5


def test_dispatch_routes_by_rows_and_layout():
    d = parse_dispatch("channel=scaled_mm_fast:16,skinny:128,scaled_mm/block=scaled_mm_block")
    assert parse_dispatch("channel=scaled_mm_fast:16,skinny:128,scaled_mm;block=scaled_mm_block") == d
    assert [d.kernel_for(m, False) for m in (1, 16, 17, 128, 129, 100_000)] == \
        ["scaled_mm_fast", "scaled_mm_fast", "skinny", "skinny", "scaled_mm", "scaled_mm"]
    assert d.kernel_for(5, True) == d.kernel_for(50_000, True) == "scaled_mm_block"
    only_block = parse_dispatch("block=triton")
    assert only_block.channel == Fp8Dispatch().channel and only_block.block == (Fp8Route(ANY_ROWS, "triton"),)
    assert parse_dispatch("") == Fp8Dispatch() and isinstance(DISPATCH, Fp8Dispatch)
    # the defaults, per channel: the skinny kernel up to 64 rows, then fast-accumulating _scaled_mm
    assert [Fp8Dispatch().kernel_for(m, False) for m in (17, 64, 65, 16384)] == \
        ["skinny", "skinny", "scaled_mm_fast", "scaled_mm_fast"]


@pytest.mark.parametrize("text,words", [
    ("channel=cublas", "not one of"),
    ("block=scaled_mm", "not one of"),  # row-wise scales cannot serve block weights
    ("channel=skinny,scaled_mm", "needs ':ROWS'"),
    ("channel=skinny:64,scaled_mm:32,triton", "must increase"),
    ("channel=skinny:x,scaled_mm", "positive integer"),
    ("rows=skinny", "is not 'channel=...'"),
])
def test_bad_routes_are_one_line_errors(text, words):
    with pytest.raises(ValueError, match=words) as e:
        parse_dispatch(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kernel,block", [("skinny", None), ("skinny", (16, 32)), ("triton", None),
                                          ("triton", (16, 32)), ("scaled_mm", None), ("scaled_mm_fast", None)])
def test_each_routed_kernel_matches_the_reference(kernel, block):
    """The kernels as the table calls them (their default tiles: interpreter-sized shapes)."""
    if kernel.startswith("scaled_mm") and DEVICE == "cpu" and not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no _scaled_mm")
    w = _weight(64, 256, block, True)
    x, b = _x(24, 256), _x(1, 64, seed=2)[0]
    _close(fp8_product(x, w, b, kernel), fp8_linear_ref(x.float(), w, b.float(), quantize_input=True))


def test_linear_add_takes_the_routed_kernel_with_its_residual(monkeypatch):
    """`fp8_linear_add_` on CUDA adds in the routed Triton kernel's epilogue (the table says
    skinny at these rows); on the CPU it is the reference: both equal r + x W^T."""
    import slipstream.ops.fp8_dispatch as fd
    monkeypatch.setattr(fd, "DISPATCH", parse_dispatch("channel=skinny:64,scaled_mm"))
    w = _weight(48, 96, None, False)
    x, r = _x(20, 96), _x(20, 48, seed=6)
    expect = r.float() + fp8_linear_ref(x.float(), w, quantize_input=DEVICE == "cuda")
    out = fp8_linear_add_(r, x, w)
    assert out is r
    _close(r, expect)


@pytest.mark.parametrize("group,inter", [(None, 80), (16, 80), (None, 17000)])  # 17000: two passes
@pytest.mark.parametrize("with_hidden", [False, True])
def test_silu_mul_inside_the_quantization_has_silu_and_mul_then_its_bits(group, with_hidden, inter):
    """`SiluMulRows`: SiLU·mul (rows scaled by rstd(hidden)) computed inside the per-token
    quantization gives the codes and scales of `silu_and_mul` followed by the quantization
    (the engine's two kernels before), and against the reference's cast of silu_and_mul_ref."""
    from slipstream.ops.fused import silu_and_mul, silu_and_mul_ref
    from slipstream.ops.triton_fp8_quant import SiluMulRows, quantize_rows
    from slipstream.quant.fp8 import quantize_per_token
    m = 7 if inter < 1000 else 2
    gate_up = _x(m, 2 * inter, seed=11)
    hidden = _x(m, 48, seed=12) * 7 if with_hidden else None  # far from unit RMS
    q, s = quantize_rows(SiluMulRows(gate_up, hidden, 1e-5), None, group)
    assert q.shape == (m, inter) and s.shape == (m, 1 if group is None else -(-inter // 16))
    act = silu_and_mul(gate_up, hidden=hidden, eps=1e-5)
    q2, s2 = quantize_rows(act, None, group)
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    qr, sr = quantize_per_token(silu_and_mul_ref(gate_up, hidden, 1e-5).float(), group)
    # against the reference, values (+0 and -0 alike: a product of ±0 is the same): exp's last
    # bits aside (on an H100 1.1% of the 17000-column codes differed bit for bit, zeros' signs
    # among them)
    assert (q.float() != qr.float()).float().mean() < 0.01
    torch.testing.assert_close(s, sr, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("kernel,block", [("skinny", None), ("skinny", (16, 32)), ("triton", None)])
def test_routed_kernels_take_a_silu_mul_input_with_the_same_bits(kernel, block):
    """fp8_product on `SiluMulRows` (the down product at more than the GEMV's rows) equals the
    product of silu_and_mul's output, residual in place included."""
    from slipstream.ops.fused import silu_and_mul
    from slipstream.ops.triton_fp8_quant import SiluMulRows
    w = _weight(48, 96, block, False)
    gate_up, hidden = _x(20, 192, seed=13), _x(20, 64, seed=14)
    r1, r2 = _x(20, 48, seed=15), _x(20, 48, seed=15)
    assert fp8_product(SiluMulRows(gate_up, hidden, 1e-6), w, None, kernel, residual=r1, out=r1) is r1
    fp8_product(silu_and_mul(gate_up, hidden=hidden, eps=1e-6), w, None, kernel, residual=r2, out=r2)
    assert torch.equal(r1, r2)


def test_fp8_down_product_takes_silu_mul_rows_past_the_gemv():
    """`fp8_silu_mul_linear_add_` above the GEMV's rows: r + silu_and_mul(gate_up, hidden) W^T
    (on the CPU the reference path, on CUDA the fused quantization and the routed kernel)."""
    from slipstream.ops.fp8_linear import fp8_silu_mul_linear_add_
    from slipstream.ops.fused import silu_and_mul_ref
    w = _weight(48, 96, None, False)
    gate_up, hidden, r = _x(24, 192, seed=16), _x(24, 64, seed=17), _x(24, 48, seed=18)
    act = silu_and_mul_ref(gate_up, hidden, 1e-6)
    expect = r.float() + fp8_linear_ref(act.float(), w, quantize_input=DEVICE == "cuda")
    assert fp8_silu_mul_linear_add_(r, gate_up, w, hidden=hidden, eps=1e-6) is r
    _close(r, expect)


@pytest.mark.parametrize("m,k", [(5, 72), (3, 5000)])
def test_per_tensor_quantization_equals_the_reference_bit_for_bit(m, k):
    """One scale for all rows (a loud row sets it); K past one 2048-wide chunk, partly. Normal
    e4m3 values bit for bit; below 2^-6 (subnormal, where the loud row pushes the others)
    within one subnormal step: Triton's interpreter casts those by truncation, the GPU to
    nearest (the same caveat as the per-token kernel's)."""
    from slipstream.ops.triton_fp8_quant_tensor import quantize_tensor
    from slipstream.quant.fp8 import quantize_per_tensor
    x = _x(m, k)
    x[1] *= 50.0
    q, s = quantize_tensor(x)
    qr, sr = quantize_per_tensor(x.float())
    assert s.shape == (1,) and torch.equal(s, sr[:1])
    normal = (x.float() / s).abs() >= 2.0 ** -6
    assert normal.float().mean() > 0.5
    assert torch.equal(q.view(torch.uint8)[normal], qr.view(torch.uint8)[normal])
    assert (q.float() - qr.float()).abs().max() <= 2.0 ** -9


def test_small_256_fp8_is_small_256_with_fp8_weights_and_kv_cache():
    from slipstream.bench.workloads import get_workload
    w, p = get_workload("small-256-fp8"), get_workload("small-256")
    assert w.name == "small-256-fp8" and w.engine == {**p.engine, "quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert w.prompts == p.prompts and w.params == p.params


# --- GPU: the 8B shape's sizes ---

SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 2, 8, 17, 32, 64, 100, 256])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_gpu_skinny_at_8b_sizes(n, k, m, block):
    w = _weight(n, k, block, True)
    x, r = _x(m, k), _x(m, n, seed=4)
    ref = fp8_linear_ref(x.float(), w, quantize_input=True)
    _close(fp8_gemm_skinny(x, w), ref)
    expect = r.float() + ref
    fp8_gemm_skinny(x, w, residual=r, out=r)
    _close(r, expect)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 300])
def test_gpu_down_product_with_silu_mul_in_the_quantization_at_8b_sizes(m):
    """The 8B down product through `fp8_silu_mul_linear_add_` (the fused quantization, the
    routed kernel) against silu_and_mul then `fp8_linear_add_`: the same bits."""
    from slipstream.ops.fp8_linear import fp8_silu_mul_linear_add_
    from slipstream.ops.fused import silu_and_mul
    w = _weight(4096, 14336, None, False)
    gate_up, hidden = _x(m, 2 * 14336, seed=19), _x(m, 4096, seed=20)
    r1, r2 = _x(m, 4096, seed=21), _x(m, 4096, seed=21)
    fp8_silu_mul_linear_add_(r1, gate_up, w, hidden=hidden, eps=1e-5)
    fp8_linear_add_(r2, silu_and_mul(gate_up, hidden=hidden, eps=1e-5), w)
    diff = r1 != r2
    assert not diff.any(), (f"{int(diff.sum())} of {diff.numel()} outputs in {int(diff.any(1).sum())} rows differ, "
                            f"by up to {(r1.float() - r2.float()).abs().max().item():.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["skinny", "scaled_mm", "scaled_mm_fast"])
def test_gpu_routed_kernels_replay_in_a_cuda_graph(kernel):
    w = _weight(4096, 14336, None, True)
    x = _x(32, 14336)
    y = fp8_product(x, w, None, kernel)  # compile / pick the kernel first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_product(x, w, None, kernel)
    for seed in (9, 10):  # twice: the skinny split's counters are back at zero after a replay
        x.copy_(_x(32, 14336, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        ref = fp8_linear_ref(x.float(), w, quantize_input=True)
        if kernel == "scaled_mm_fast":  # the tensor cores' own sum over K: its bound (test below)
            err = rel_rms(y, ref)
            assert err < 2 ** -6
        else:
            _close(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_gpu_fast_accumulation_error_is_a_quarter_of_e4m3s(n, k):
    """`use_fast_accum=True` sums all of K in the tensor cores' accumulator (fewer bits than
    fp32). Against the exact (float64) product of the same FP8 operands its relative RMS
    error must stay under 2^-6, a quarter of what e4m3's rounding of the inputs already costs
    (each operand within 2^-4, ~2^-4 relative RMS on the product): FP8 accuracy is kept."""
    from slipstream.ops.triton_fp8_quant import quantize_rows
    w = _weight(n, k, None, False)
    x = _x(256, k)
    q, s = quantize_rows(x)
    exact = (q.double() * s.double()) @ (w.qweight.double() * w.scale.double()[:, None]).t()
    for fast in (False, True):
        y = torch._scaled_mm(q, w.qweight.t(), scale_a=s, scale_b=w.scale[None, :], out_dtype=torch.bfloat16,
                             use_fast_accum=fast)
        err = rel_rms(y, exact)
        print(f"n={n} k={k} fast_accum={fast}: relative RMS error {err:.2e}")
        assert err < 2 ** -6


@pytest.mark.gpu
def test_gpu_block_scaled_mm_matches_the_reference_where_torch_has_it():
    from slipstream.ops.fp8_dispatch import scaled_mm_blockwise
    w = _weight(6144, 4096, (128, 128), True)
    x = _x(256, 4096)
    try:
        y = scaled_mm_blockwise(x, w)
    except RuntimeError as e:  # torch < 2.9 or cuBLASLt < 12.9: the table must not route to it
        pytest.skip(f"block-scaled _scaled_mm unsupported here: {str(e).splitlines()[0]}")
    _close(y, fp8_linear_ref(x.float(), w, quantize_input=True))


# --- compiled for Hopper without a GPU ---

def compile_skinny_for_hopper() -> list[str]:
    """The skinny GEMM's launches at the 8B shape (per channel at 32 rows, K split; 128x128
    blocks at 17 rows; the down product into the residual at 64 rows; each with its weight
    prefetch before the PDL wait, which the interpreter cannot run) and the
    persistent 128x128 Triton GEMM on block weights at 2048 rows, and the per-tensor
    quantization's two kernels, compiled for sm_90: returns each launch's wgmma instruction."""
    import re

    from test_attention_kernels import compile_launch_for_hopper, recorded_launches

    import slipstream.ops.triton_fp8_gemm as tm
    import slipstream.ops.triton_fp8_gemm_skinny as ts
    import slipstream.ops.triton_fp8_quant as tq
    bf, f8 = torch.bfloat16, torch.float8_e4m3fn

    def weight(n, k, block):
        scale = torch.ones((n // 128, k // 128) if block else (n,))
        return Fp8Weight(torch.zeros(n, k, dtype=f8), scale, block, None)

    launches: list = []
    with recorded_launches(tq, ["_quant_rows_kernel"], []), recorded_launches(ts, ["_fp8_skinny_kernel"], launches), \
            recorded_launches(tm, ["_fp8_gemm_kernel"], launches):
        ts.fp8_gemm_skinny(torch.zeros(32, 4096, dtype=bf), weight(4096, 4096, None))
        ts.fp8_gemm_skinny(torch.zeros(17, 4096, dtype=bf), weight(6144, 4096, (128, 128)))
        h = torch.zeros(64, 4096, dtype=bf)
        ts.fp8_gemm_skinny(torch.zeros(64, 14336, dtype=bf), weight(4096, 14336, None), residual=h, out=h)
        tm.fp8_gemm(torch.zeros(2048, 4096, dtype=bf), weight(6144, 4096, (128, 128)),
                    cfg=tm.Fp8GemmConfig(128, 128, 128, 8, 8, 4, persistent=True))
    import slipstream.ops.triton_fp8_quant_tensor as tt
    with recorded_launches(tt, ["_row_amax_kernel", "_quant_tensor_kernel"], launches):
        tt.quantize_tensor(torch.zeros(64, 14336, dtype=bf))  # (no dots: listed as "")
    found = []
    for fn, args, kw in launches:
        if "PREFETCH_K" in kw:  # as on a GPU, with PDL on: the weight rows' L2 prefetch before the wait
            kw = dict(kw, PREFETCH_K=ts.DEFAULT_FP8_SKINNY_CONFIG.prefetch_k)
        ptx = compile_launch_for_hopper(fn, args, kw)[0].asm["ptx"]
        found.append(",".join(sorted(set(re.findall(r"wgmma\.mma_async\.\S+", ptx)))))
        if "PREFETCH_K" in kw:
            assert 0 <= ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"), "prefetch after the wait"
        print("compiled", found[-1])
    return found


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU tests compile the kernels")
def test_skinny_and_persistent_gemm_compile_for_hopper_on_fp8_wgmma():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    lines = [ln for ln in out.splitlines() if ln.startswith("compiled")]
    # the activation rows on the MMA's narrow side: n32 for 17 and 32 rows, n64 for 64; the
    # persistent 128x128 tile on two warpgroups of m64n128; the per-tensor quantization's two kernels
    assert lines == ["compiled wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3"] * 2 + \
        ["compiled wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3",
         "compiled wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3", "compiled ", "compiled "], out


if __name__ == "__main__":
    import sys
    if "--compile-for-hopper" in sys.argv:
        compile_skinny_for_hopper()
