"""Triton element-wise kernels (slipstream/ops/triton_fused.py, triton_qkv_epilogue.py) vs
their torch references.

On a machine without a GPU they run under Triton's interpreter (tests/conftest.py) at tiny
sizes; the `gpu` tests check real sizes on CUDA.
"""
import math

import pytest
import torch

from slipstream.ops import fused
from slipstream.ops.triton_fused import rms_norm_triton, silu_and_mul_triton
from slipstream.ops.triton_qkv_epilogue import epilogue_launch, qkv_epilogue_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    # fp32: summation order only; bf16: one bf16 rounding step of the result
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)  # on the GPU for the big GPU tests
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


# ------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 8), (5, 37), (3, 300), (2, 1024)])
def test_rms_norm(dtype, rows, hidden):
    x = _randn(rows, hidden, dtype=dtype, seed=1, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=2)
    ref = fused.rms_norm_ref(x, w, 1e-6)
    out = torch.full_like(ref, float("nan"))
    got = rms_norm_triton(x, w, 1e-6, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, **_tol(dtype))
    # default allocation path and a 3-D input
    got3 = rms_norm_triton(x.view(1, rows, hidden), w, 1e-6)
    torch.testing.assert_close(got3.view(rows, hidden), ref, **_tol(dtype))


def test_rms_norm_mixed_dtype_weight():
    # fp32 weight with bf16 activations promotes to fp32, as in the reference
    x = _randn(4, 64, dtype=torch.bfloat16, seed=3)
    w = _randn(64, dtype=torch.float32, seed=4)
    ref = fused.rms_norm_ref(x, w, 1e-5)
    got = rms_norm_triton(x, w, 1e-5)
    assert got.dtype == ref.dtype == torch.float32
    # the normalised value is rounded to bf16 before the weight: bf16 tolerance
    torch.testing.assert_close(got, ref, **_tol(torch.bfloat16))


def test_rms_norm_strided_rows():
    # rows of a wider buffer (row stride != hidden)
    buf = _randn(6, 80, dtype=torch.float32, seed=5)
    x = buf[:, 8:72]
    w = _randn(64, dtype=torch.float32, seed=6)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6),
                               atol=1e-5, rtol=1e-5)


def test_row_rstd_and_scale_rows_ref():
    # the statistic of a folded norm: rms_norm(h) = h * rstd(h), and the finish of a GEMM
    # that read h with gamma folded into its weights equals the unfolded computation
    h = _randn(4, 48, dtype=torch.float32, seed=7, scale=3.0)
    gamma = _randn(48, dtype=torch.float32, seed=8)
    w = _randn(20, 48, dtype=torch.float32, seed=9)
    b = _randn(20, dtype=torch.float32, seed=10)
    torch.testing.assert_close(h * fused.row_rstd_ref(h, 1e-6), fused.rms_norm_ref(h, torch.ones(48, device=DEV), 1e-6))
    unfolded = fused.rms_norm_ref(h, gamma, 1e-6) @ w.t() + b
    folded = fused.scale_rows_ref(h @ (w * gamma[None, :]).t(), h, 1e-6, b)
    torch.testing.assert_close(folded, unfolded, atol=1e-5, rtol=1e-5)
    x = _randn(3, 5, dtype=torch.bfloat16, seed=11)
    assert fused.scale_rows_ref(x, None, 1e-6) is x  # nothing to finish


# ------------------------------------------------------------------------- RoPE cache (qkv epilogue)

def _cache(head_dim, max_pos=64, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return fused.build_cos_sin_cache(inv_freq, max_pos).to(DEV)


# ------------------------------------------------------------------------- SiLU * mul

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1), (3, 37), (2, 1500)])
def test_silu_and_mul(dtype, rows, inter):
    x = _randn(rows, 2 * inter, dtype=dtype, seed=16, scale=4.0)
    ref = fused.silu_and_mul_ref(x)
    out = torch.full_like(ref, float("nan"))
    got = silu_and_mul_triton(x, out=out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter,hidden", [(1, 8, 16), (3, 37, 45), (2, 700, 8200)])
def test_silu_and_mul_row_scale(dtype, rows, inter, hidden):
    # the folded post-attention norm: gate and up scaled by rstd of the residual row
    x = _randn(rows, 2 * inter, dtype=dtype, seed=36, scale=4.0)
    h = _randn(rows, hidden, dtype=dtype, seed=37, scale=5.0)
    ref = fused.silu_and_mul_ref(x, h, 1e-6)
    assert not torch.allclose(ref.float(), fused.silu_and_mul_ref(x).float(), atol=1e-3)
    torch.testing.assert_close(silu_and_mul_triton(x, hidden=h, eps=1e-6), ref, **_tol(dtype))
    with pytest.raises(ValueError):
        silu_and_mul_triton(x, hidden=h[:-1] if rows > 1 else h[:, :0].reshape(0, hidden))


def test_silu_and_mul_strided_rows():
    buf = _randn(3, 100, dtype=torch.float32, seed=17)
    x = buf[:, :60]
    torch.testing.assert_close(silu_and_mul_triton(x), fused.silu_and_mul_ref(x),
                               atol=1e-5, rtol=1e-5)


def test_outputs_into_padded_buffers_leave_padding_alone():
    # outputs are row views of wider NaN buffers: the kernels must write exactly [T, N]
    T, I, H = 3, 37, 45
    x = _randn(T, 2 * I, dtype=torch.float32, seed=32)
    big = torch.full((T, I + 5), float("nan"), device=DEV)
    silu_and_mul_triton(x, out=big[:, :I])
    torch.testing.assert_close(big[:, :I], fused.silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)
    assert torch.isnan(big[:, I:]).all()

    h = _randn(T, H, dtype=torch.float32, seed=33)
    w = _randn(H, dtype=torch.float32, seed=35)
    o_big = torch.full((T, H + 3), float("nan"), device=DEV)
    rms_norm_triton(h, w, 1e-6, out=o_big[:, 1:H + 1])
    torch.testing.assert_close(o_big[:, 1:H + 1], fused.rms_norm_ref(h, w, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.isnan(o_big[:, 0]).all() and torch.isnan(o_big[:, H + 1:]).all()


# ------------------------------------------------------------------------- dispatch

@pytest.mark.skipif(DEV == "cpu", reason="dispatch goes to Triton only for CUDA tensors")
def test_dispatch_uses_triton_on_cuda():
    x = _randn(2, 64, dtype=torch.float32, seed=18)
    h = _randn(2, 40, dtype=torch.float32, seed=19)
    w = _randn(64, dtype=torch.float32, seed=20)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.silu_and_mul(x, h, 1e-6), fused.silu_and_mul_ref(x, h, 1e-6),
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- real sizes (GPU)

@pytest.mark.gpu
def test_gpu_real_sizes():
    T, H, I = 8192, 4096, 14336
    for dtype in DTYPES:
        tol = _tol(dtype)
        x = _randn(T, H, dtype=dtype, seed=21)
        w = _randn(H, dtype=dtype, seed=23)
        torch.testing.assert_close(rms_norm_triton(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5), **tol)
        x8 = _randn(64, 8192, dtype=dtype, seed=24)
        w8 = _randn(8192, dtype=dtype, seed=25)
        torch.testing.assert_close(rms_norm_triton(x8, w8, 1e-5), fused.rms_norm_ref(x8, w8, 1e-5), **tol)

        g = _randn(T, 2 * I, dtype=dtype, seed=26)
        torch.testing.assert_close(silu_and_mul_triton(g), fused.silu_and_mul_ref(g), **tol)
        torch.testing.assert_close(silu_and_mul_triton(g, hidden=x, eps=1e-5),
                                   fused.silu_and_mul_ref(g, x, 1e-5), **tol)
        del g


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    T, H, I = 32, 4096, 1024
    x = _randn(T, H, dtype=torch.bfloat16, seed=29)
    g = _randn(T, 2 * I, dtype=torch.bfloat16, seed=30)
    w = _randn(H, dtype=torch.bfloat16, seed=31)
    xs, gs = x.clone(), g.clone()
    rms_norm_triton(xs, w, 1e-5)  # compile outside the graph
    silu_and_mul_triton(gs, hidden=xs, eps=1e-5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go = rms_norm_triton(xs, w, 1e-5)
        so = silu_and_mul_triton(gs, hidden=xs, eps=1e-5)
    xs.copy_(x * 2)
    gs.copy_(g * 2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(go, fused.rms_norm_ref(x * 2, w, 1e-5), **_tol(torch.bfloat16))
    torch.testing.assert_close(so, fused.silu_and_mul_ref(g * 2, x * 2, 1e-5), **_tol(torch.bfloat16))
    assert math.isfinite(go.float().sum().item())


# ------------------------------------------------------------------------- qkv epilogue
# q/k RMSNorm + RoPE + paged KV store in one kernel (qkv_epilogue_triton) against the
# composed references (qkv_epilogue_ref).

def _epilogue_case(T, hq, hk, D, dtype, qk_norm, seed, num_blocks=8, block_size=4, max_pos=64,
                   norm_dtype=None, hidden_size=0, bias=False):
    g = _gen(seed)
    qkv = _randn(T, (hq + 2 * hk) * D, dtype=dtype, seed=seed, scale=2.0)
    positions = torch.randint(0, max_pos, (T,), generator=g).to(DEV)
    # scattered slots over several blocks, every third token padding (-1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T].to(torch.int32)
    slots[::3] = -1
    nd = norm_dtype or dtype
    qw = _randn(D, dtype=nd, seed=seed + 1) if qk_norm else None
    kw = _randn(D, dtype=nd, seed=seed + 2) if qk_norm else None
    cache_shape = (num_blocks, block_size, hk, D)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEV)
    # the residual stream of a folded input norm, and the qkv bias (Qwen2)
    hidden = _randn(T, hidden_size, dtype=dtype, seed=seed + 3, scale=3.0) if hidden_size else None
    b = _randn(qkv.shape[1], dtype=dtype, seed=seed + 4) if bias else None
    return dict(qkv=qkv, positions=positions, cos_sin_cache=_cache(D, max_pos=max_pos),
                k_cache=k_cache, v_cache=v_cache, slot_mapping=slots.to(DEV), num_heads=hq,
                num_kv_heads=hk, head_dim=D, q_norm_weight=qw, k_norm_weight=kw, eps=1e-6,
                hidden=hidden, bias=b)


def _run_epilogue(case, **kw):
    """(ref q, ref caches, triton q, triton caches, the qkv the kernel worked on)."""
    ref_args = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    ref_q = fused.qkv_epilogue_ref(**ref_args)
    qkv = case["qkv"].clone()
    got_args = dict(case, qkv=qkv, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    got_q = qkv_epilogue_triton(**got_args, **kw)
    return (ref_q, ref_args["k_cache"], ref_args["v_cache"],
            got_q, got_args["k_cache"], got_args["v_cache"], qkv)


def _epi_tol(dtype):
    if dtype == torch.float16:  # RNE on both sides; only the RMS sum order differs
        return dict(atol=1e-5, rtol=2 ** -10)
    return _tol(dtype)


def _check_epilogue(case, ref_q, ref_kc, ref_vc, got_q, got_kc, got_vc, exact_fp32_rope=True):
    dtype = case["qkv"].dtype
    tol = _epi_tol(dtype)
    T, hq, D = ref_q.shape
    assert got_q.shape == (T, hq, D) and got_q.dtype == ref_q.dtype and got_q.stride(-1) == 1
    # unwritten slots stay NaN, written ones are finite and match
    written = torch.zeros(ref_kc.shape[0] * ref_kc.shape[1], dtype=torch.bool, device=DEV)
    sm = case["slot_mapping"][:T]  # entries past T (padded buffers) are not used
    written[sm[sm >= 0].long()] = True
    for ref_c, got_c in ((ref_kc, got_kc), (ref_vc, got_vc)):
        flat = got_c.view(-1, *got_c.shape[2:])
        assert torch.isnan(flat[~written]).all()
        assert not torch.isnan(flat[written]).any()
    got_v = got_vc.view(-1, *got_vc.shape[2:])[written]
    ref_v = ref_vc.view(-1, *ref_vc.shape[2:])[written]
    if case["hidden"] is None and case["bias"] is None:
        assert torch.equal(got_v, ref_v)  # v is a copy: bitwise
    else:
        torch.testing.assert_close(got_v, ref_v, **tol)
    has_norm = case["q_norm_weight"] is not None
    if dtype == torch.float32 and not has_norm and exact_fp32_rope and case["hidden"] is None:
        tol = dict(atol=0, rtol=0)  # same fp32 ops in the same order (no FMA contraction)
    torch.testing.assert_close(got_q, ref_q, **tol)
    torch.testing.assert_close(got_kc, ref_kc, equal_nan=True, **tol)
    if dtype == torch.float16 and DEV == "cpu":
        # fp16 rounds to nearest-even in the interpreter too: the rounding points of the
        # reference are reproduced (almost) bit for bit
        assert (got_q == ref_q).float().mean() > 0.99


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype,hq,hk,D", [
    (torch.float32, 4, 2, 16), (torch.float32, 3, 1, 64),
    (torch.bfloat16, 4, 2, 64), (torch.bfloat16, 3, 1, 16),
    (torch.float16, 4, 2, 16),
])
@pytest.mark.quick_sample(1)
def test_qkv_epilogue(dtype, hq, hk, D, qk_norm):
    case = _epilogue_case(7, hq, hk, D, dtype, qk_norm, seed=40 + D + hq)
    qkv0 = case["qkv"].clone()
    ref_q, ref_kc, ref_vc, got_q, got_kc, got_vc, qkv = _run_epilogue(case)
    assert torch.equal(case["qkv"], qkv0)  # the reference leaves qkv alone
    _check_epilogue(case, ref_q, ref_kc, ref_vc, got_q, got_kc, got_vc)
    # documented default: q written in place into the q columns of qkv; k, v columns untouched
    assert got_q.data_ptr() == qkv.data_ptr() and got_q.stride() == (qkv.stride(0), D, 1)
    assert torch.equal(qkv[:, hq * D:], qkv0[:, hq * D:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm,hidden_size,bias", [(False, 48, False), (True, 48, False),
                                                      (False, 0, True), (False, 8200, True)])
@pytest.mark.quick_sample(1)
def test_qkv_epilogue_row_scale_and_bias(dtype, qk_norm, hidden_size, bias):
    # the folded input norm's row scale (8200: wider than one row_rstd block, the loop) and
    # the qkv bias, applied before the q/k norm and RoPE, and to v
    case = _epilogue_case(7, 4, 2, 16, dtype, qk_norm, seed=45 + hidden_size, hidden_size=hidden_size,
                          bias=bias)
    result = _run_epilogue(case)
    _check_epilogue(case, *result[:6])
    # it does change v (q and k too, unless their own norms make them scale-invariant)
    plain_vc = case["v_cache"].clone()
    plain_q = fused.qkv_epilogue_ref(**dict(case, hidden=None, bias=None, k_cache=case["k_cache"].clone(),
                                            v_cache=plain_vc))
    assert not torch.allclose(plain_vc.nan_to_num(), result[2].nan_to_num(), atol=1e-2)
    assert qk_norm or not torch.allclose(plain_q.float(), result[0].float(), atol=1e-2)
    with pytest.raises(ValueError):
        qkv_epilogue_triton(**dict(case, hidden=_randn(3, 8, dtype=dtype, seed=1)))


@pytest.mark.parametrize("dtype,qk_norm,hidden_size,bias", [
    (torch.float32, False, 0, False), (torch.bfloat16, True, 48, False), (torch.float32, False, 48, True)])
@pytest.mark.slow
@pytest.mark.quick_sample(1)
def test_qkv_epilogue_with_loads_before_the_wait(dtype, qk_norm, hidden_size, bias):
    # prefetch_tokens: positions, cos/sin rows and slots loaded before the PDL wait, the same
    # results bit for bit as the kernel without (7 tokens: on at 7 and 8, off at 6)
    case = _epilogue_case(7, 4, 2, 16, dtype, qk_norm, seed=61 + hidden_size, hidden_size=hidden_size,
                          bias=bias)
    plain = _run_epilogue(case)
    for prefetch in (7, 8, 6):
        early = _run_epilogue(case, prefetch_tokens=prefetch)
        _check_epilogue(case, *early[:6])
        for a, b in zip(plain[3:6], early[3:6]):
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def test_epilogue_launch_shape():
    # 1024-element blocks at decode sizes, 2048 at prefill sizes, 4 warps; in batch-invariant
    # mode one shape at every token count (the rstd and q/k norm reductions keep their order)
    assert epilogue_launch(211, 16, 8, 128) == (8, 4)
    assert epilogue_launch(8192, 16, 8, 128) == (16, 4)
    assert {epilogue_launch(t, 16, 8, 128, batch_invariant=True) for t in (1, 37, 211, 8192)} == {(8, 4)}
    assert {epilogue_launch(t, 9, 3, 64, batch_invariant=True) for t in (1, 4096)} == {(16, 4)}
    # the invariant shape runs and agrees with the reference
    case = _epilogue_case(5, 4, 2, 16, torch.float32, True, seed=46, hidden_size=40)
    _check_epilogue(case, *_run_epilogue(case, batch_invariant=True)[:6])


@pytest.mark.slow
def test_qkv_epilogue_out_blocking_and_int64_indices():
    # out= buffer, forced one-head blocks (heads masked at the tail), int64 positions/slots,
    # positions / slot_mapping longer than T (CUDA-graph padded buffers), and a T the grid
    # heuristic would split differently
    case = _epilogue_case(5, 6, 2, 32, torch.float32, True, seed=50, num_blocks=4, block_size=8)
    case["positions"] = torch.cat([case["positions"], torch.zeros(3, dtype=torch.long, device=DEV)])
    case["slot_mapping"] = torch.cat([case["slot_mapping"].long(),
                                      torch.full((3,), 7, dtype=torch.long, device=DEV)])
    for bh in (1, 4):
        out = torch.full((5, 6, 32), float("nan"), device=DEV)
        ref_q, ref_kc, ref_vc, got_q, got_kc, got_vc, qkv = _run_epilogue(case, out=out, block_h=bh)
        assert got_q.data_ptr() == out.data_ptr()
        assert torch.equal(qkv, case["qkv"])  # with out=, qkv is not written
        _check_epilogue(case, ref_q, ref_kc, ref_vc, got_q, got_kc, got_vc)


def test_qkv_epilogue_fp32_norm_weight_promotes():
    # fp32 q/k norm weights with bf16 activations: the norm's result is fp32 (as in
    # rms_norm_ref), so q comes back fp32 in a new tensor and k is rounded once into the cache
    case = _epilogue_case(4, 2, 1, 16, torch.bfloat16, True, seed=60, norm_dtype=torch.float32)
    ref_q, ref_kc, ref_vc, got_q, got_kc, got_vc, qkv = _run_epilogue(case)
    assert ref_q.dtype == got_q.dtype == torch.float32
    assert got_q.data_ptr() != qkv.data_ptr()
    _check_epilogue(case, ref_q, ref_kc, ref_vc, got_q, got_kc, got_vc)


def test_qkv_epilogue_empty_and_bad_shapes():
    case = _epilogue_case(3, 2, 1, 16, torch.float32, False, seed=70)
    empty = dict(case, qkv=case["qkv"][:0])
    assert qkv_epilogue_triton(**empty).shape == (0, 2, 16)
    with pytest.raises(ValueError):
        qkv_epilogue_triton(**dict(case, num_heads=3))
    with pytest.raises(ValueError):
        qkv_epilogue_triton(**dict(case, qkv=case["qkv"].t().contiguous().t()))


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_qkv_epilogue_real_sizes(qk_norm):
    hq, hk, D = 32, 8, 128
    for T in (256, 8192):
        case = _epilogue_case(T, hq, hk, D, torch.bfloat16, qk_norm, seed=80 + T,
                              num_blocks=T // 16 + 8, block_size=16, max_pos=32768)
        _check_epilogue(case, *_run_epilogue(case)[:6])
    # fp32 at decode size: bitwise without the norm
    case = _epilogue_case(256, hq, hk, D, torch.float32, qk_norm, seed=90,
                          num_blocks=24, block_size=16, max_pos=32768)
    _check_epilogue(case, *_run_epilogue(case)[:6])


@pytest.mark.gpu
def test_gpu_qkv_epilogue_cuda_graph():
    case = _epilogue_case(64, 32, 8, 128, torch.bfloat16, True, seed=95, num_blocks=16,
                          block_size=16, max_pos=4096)
    ref_q, ref_kc, ref_vc = _run_epilogue(case)[:3]
    qkv = case["qkv"].clone()
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    args = dict(case, qkv=qkv, k_cache=kc, v_cache=vc)
    qkv_epilogue_triton(**dict(args, qkv=qkv.clone(), k_cache=kc.clone(), v_cache=vc.clone()))
    torch.cuda.synchronize()  # compiled outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_q = qkv_epilogue_triton(**args)
    qkv.copy_(case["qkv"])
    graph.replay()
    torch.cuda.synchronize()
    _check_epilogue(case, ref_q, ref_kc, ref_vc, got_q, kc, vc)


@pytest.mark.skipif(DEV == "cpu", reason="dispatch goes to Triton only for CUDA tensors")
def test_qkv_epilogue_dispatch_uses_triton_on_cuda():
    case = _epilogue_case(6, 4, 2, 64, torch.float32, True, seed=99)
    ref_q = fused.qkv_epilogue_ref(**dict(case, k_cache=case["k_cache"].clone(),
                                         v_cache=case["v_cache"].clone()))
    qkv = case["qkv"].clone()
    got = fused.qkv_epilogue(**dict(case, qkv=qkv))
    assert got.data_ptr() == qkv.data_ptr()  # Triton's in-place q
    torch.testing.assert_close(got, ref_q, atol=1e-5, rtol=1e-5)
