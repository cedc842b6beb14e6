"""The FP8 KV cache (kv_cache_dtype="fp8"): its rounding, the qkv epilogue's quantizing
store, the decode and prefill kernels' FP8 reads (Triton's interpreter on the CPU, tiny
sizes; real sizes with @gpu), against the torch references and against a bf16 cache on the
same inputs within a bound derived from e4m3's precision (`fp8_bound`)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_attention_kernels import SMALL_DECODE, SMALL_PREFILL, make_batch

from slipstream.ops.attention import paged_attention_ref
from slipstream.ops.attention_tuning import DecodeConfig
from slipstream.ops.fused import build_cos_sin_cache, qkv_epilogue_ref
from slipstream.ops.kv_quant import (FP8_ABS_ERR, FP8_DTYPE, FP8_MAX, FP8_REL_ERR, KVScales,
                                     dequantize_ref, kv_cache_torch_dtype, quantize_ref)
from slipstream.ops.triton_attention import paged_attention_triton
from slipstream.ops.triton_qkv_epilogue import qkv_epilogue_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALES = KVScales(k_scale=0.03, v_scale=0.02)  # randn / scale stays well inside +-448


def to_fp8(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """A cache quantized the way the qkv epilogue stores it (NaN poison stays NaN)."""
    return quantize_ref(cache, 1.0 / scale)


def fp8_bound(q, kc, vc, k8, v8, meta, scale: float, sc: KVScales) -> float:
    """A bound on |attention(FP8 cache) - attention(exact cache)| over every output element.

    The FP8 cache holds K + dK and V + dV, each element's error within e4m3's rounding
    (|dx| <= FP8_REL_ERR |x| + FP8_ABS_ERR x scale: `test_quantize_rounds_...`).  A query's
    score of key j moves by s_j = softmax_scale x |q . dK_j|; with d = max_j s_j each softmax
    weight moves by a factor within exp(+-2d), so the weights' total change is at most
    exp(2d) - 1 and the output's at most max|dV| + (exp(2d) - 1) max|V| (sums over the
    sequence's keys; the maxima over the batch; the dK, dV are the cache's actual errors)."""
    dk = (dequantize_ref(k8, sc.k_scale) - kc.float()).nan_to_num(0.0)
    dv = (dequantize_ref(v8, sc.v_scale) - vc.float()).nan_to_num(0.0)
    v_max = vc.float().nan_to_num(0.0).abs().amax()
    num_kv_heads, head_dim = kc.shape[2], kc.shape[3]
    group = q.shape[1] // num_kv_heads
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    d = 0.0
    for i, seq_len in enumerate(lens):
        if seq_len == 0 or starts[i + 1] == starts[i]:
            continue
        blocks = meta.block_table[i, :-(-seq_len // kc.shape[1])].long()
        dki = dk[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
        qi = q[starts[i]:starts[i + 1]].float()
        d = max(d, scale * torch.einsum("qhd,khd->hqk", qi, dki).abs().max().item())
    return float(dv.abs().max() + (math.exp(2 * d) - 1) * v_max)


# ----------------------------------------------------------------------------- rounding

def test_quantize_rounds_to_nearest_and_saturates():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, -3.3, 447.0, 449.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -11])
    q = quantize_ref(x, 1.0)
    assert q.dtype == FP8_DTYPE
    # 1.0625 is halfway between 1.0 and 1.125: ties to even; 1e6 saturates (no NaN)
    assert q.float().tolist() == [0.0, 1.0, 1.0, 1.25, -3.25, 448.0, 448.0, FP8_MAX, -FP8_MAX, 2.0 ** -9, 0.0]
    # the relative bound of e4m3 for normal values, the absolute one below them
    y = torch.randn(10000) * 50
    err = (quantize_ref(y, 1.0).float() - y).abs()
    assert (err <= FP8_REL_ERR * y.abs() + FP8_ABS_ERR).all()
    assert err.max() > 0.5 * FP8_REL_ERR * 100  # it does round (not a no-op)
    # scales: value x scale is the real number
    assert torch.allclose(dequantize_ref(quantize_ref(y, 1 / 0.5), 0.5), y, rtol=FP8_REL_ERR, atol=1e-3)


def test_kv_cache_dtype_names_and_scales():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8_DTYPE
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("int8", torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale"):
        KVScales(k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale"):
        KVScales(v_scale=float("nan"))


# ----------------------------------------------------------------------------- qkv epilogue

def epilogue_inputs(T, num_heads, num_kv_heads, D, dtype, seed, norms=False):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (num_heads + 2 * num_kv_heads) * D, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 64, (T,), generator=g, dtype=torch.int32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cs = build_cos_sin_cache(inv_freq, 64)
    slots = torch.randperm(4 * 8, generator=g)[:T].to(torch.int32)
    slots[1] = -1  # a padding token: nothing stored
    w = (torch.rand(D, generator=g) + 0.5).to(dtype) if norms else None
    return qkv, positions, cs, slots, w


@pytest.mark.parametrize("dtype,norms,scales", [
    (torch.bfloat16, False, SCALES),
    (torch.float32, True, KVScales(0.5, 2.0)),
    # scales small enough that most values saturate at +-448
    (torch.bfloat16, True, KVScales(1e-3, 1e-3)),
])
def test_epilogue_stores_fp8_exactly_as_the_reference(dtype, norms, scales):
    T, Hq, Hk, D = 6, 4, 2, 32
    qkv, positions, cs, slots, w = epilogue_inputs(T, Hq, Hk, D, dtype, seed=3, norms=norms)
    shape = (4, 8, Hk, D)
    caches = [torch.zeros(shape, dtype=FP8_DTYPE) for _ in range(4)]
    q_ref = qkv_epilogue_ref(qkv, positions, cs, caches[0], caches[1], slots, Hq, Hk, D, w, w, 1e-6,
                             kv_scales=scales)
    dev = [c.to(DEVICE) for c in caches[2:]]
    q = qkv_epilogue_triton(qkv.clone().to(DEVICE), positions.to(DEVICE), cs.to(DEVICE), dev[0], dev[1],
                            slots.to(DEVICE), Hq, Hk, D, None if w is None else w.to(DEVICE),
                            None if w is None else w.to(DEVICE), 1e-6, kv_scales=scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.cpu().float(), q_ref.float(), atol=tol, rtol=tol)
    for got, want in zip(dev, caches[:2]):
        # where the kernel's norm / RoPE rounds k one input ulp (<= 2^-8 relative) apart from
        # the reference's, its e4m3 value may be one step apart (a value near 0: one input ulp
        # of the row's largest); everything else (saturation included) bit for bit
        got, want = got.cpu().float(), want.float()
        assert not torch.isnan(got).any()
        slack = 2.0 ** -7 * want.abs().max()
        assert ((got - want).abs() <= 2 * FP8_REL_ERR * want.abs() + slack).all()
        assert (got == want).float().mean() >= 0.97
    stored = caches[0].float()
    assert stored.abs().max() <= FP8_MAX and (stored != 0).sum() == (T - 1) * Hk * D
    if scales.k_scale < 0.01:
        assert (stored.abs() == FP8_MAX).any()


def test_reference_store_and_read_back_use_the_scales():
    T, Hq, Hk, D = 5, 2, 1, 16
    qkv, positions, cs, slots, _ = epilogue_inputs(T, Hq, Hk, D, torch.float32, seed=4)
    slots[1] = 7
    bf = [torch.zeros(4, 8, Hk, D) for _ in range(2)]
    f8 = [torch.zeros(4, 8, Hk, D, dtype=FP8_DTYPE) for _ in range(2)]
    sc = KVScales(0.25, 4.0)
    qkv_epilogue_ref(qkv, positions, cs, *bf, slots, Hq, Hk, D)
    qkv_epilogue_ref(qkv, positions, cs, *f8, slots, Hq, Hk, D, kv_scales=sc)
    for exact, stored, s in ((bf[0], f8[0], sc.k_scale), (bf[1], f8[1], sc.v_scale)):
        back = dequantize_ref(stored, s)
        assert (back - exact).abs().max() <= (FP8_REL_ERR * exact.abs() + FP8_ABS_ERR * s).max()
        assert not torch.equal(back, exact)


# ----------------------------------------------------------------------------- attention

def fp8_case(seqs, num_kv_heads, group, head_dim, block_size, *, seed, scales=SCALES, **kw):
    q, kc, vc, meta = make_batch(seqs, num_kv_heads, group, head_dim, block_size, torch.bfloat16,
                                 seed=seed, **kw)
    return q, kc, vc, to_fp8(kc, scales.k_scale), to_fp8(vc, scales.v_scale), meta


def check_fp8_attention(seqs, num_kv_heads, group, head_dim, block_size, *, seed, scales=SCALES,
                        atol=2e-2, **kwargs):
    """The FP8 kernels against the reference over the same FP8 cache (the bf16 kernels'
    tolerance), and against the bf16 cache within `fp8_bound` (plus that tolerance)."""
    q, kc, vc, k8, v8, meta = fp8_case(seqs, num_kv_heads, group, head_dim, block_size, seed=seed,
                                       scales=scales)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, k8, v8, meta, scale, out=out, kv_scales=scales, **kwargs)
    assert not torch.isnan(out).any()
    ref8 = paged_attention_ref(q.cpu(), k8.cpu(), v8.cpu(), _cpu(meta), scale, kv_scales=scales)
    torch.testing.assert_close(out.cpu().float(), ref8.float(), atol=atol, rtol=2e-2)
    exact = paged_attention_ref(q.cpu(), kc.cpu(), vc.cpu(), _cpu(meta), scale)
    err = (out.cpu().float() - exact.float()).abs().max().item()
    bound = fp8_bound(q, kc, vc, k8, v8, meta, scale, scales)
    assert err <= bound + atol, (err, bound)
    assert err > 0  # the cache was quantized
    return out, err, bound


def _cpu(meta):
    return replace(meta, query_start_loc=meta.query_start_loc.cpu(), seq_lens=meta.seq_lens.cpu(),
                   block_table=meta.block_table.cpu())


DECODE_SEQS = [(1, 1), (9, 1), (0, 1), (17, 1), (50, 1)]


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_reads_fp8(splits):
    check_fp8_attention(DECODE_SEQS, 2, 2, 32, 8, seed=5, decode_config=SMALL_DECODE, num_splits=splits)


def test_decode_kernel_prefetch_reads_fp8():
    # the first tile loaded before the PDL wait (small batches), its newest position after it
    cfg = DecodeConfig(block_n=16, min_chunk=16, num_warps=1, num_stages=1, prefetch_batch=8)
    check_fp8_attention(DECODE_SEQS, 1, 4, 32, 8, seed=6, decode_config=cfg, num_splits=2)


def test_prefill_kernel_reads_fp8():
    seqs = [(20, 20), (33, 7), (5, 1), (0, 2), (40, 16)]
    check_fp8_attention(seqs, 2, 2, 32, 8, seed=7, prefill_config=SMALL_PREFILL)


def test_sliding_window_reads_fp8():
    # Gemma 3's sliding layers: the window's keys only, decode and prefill
    seqs = [(30, 1), (25, 1)]
    q, kc, vc, k8, v8, meta = fp8_case(seqs, 1, 2, 32, 8, seed=8)
    out = paged_attention_triton(q, k8, v8, meta, 0.2, decode_config=SMALL_DECODE, window=8, kv_scales=SCALES)
    ref = paged_attention_ref(q.cpu(), k8.cpu(), v8.cpu(), _cpu(meta), 0.2, window=8, kv_scales=SCALES)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2e-2, rtol=2e-2)
    seqs = [(30, 12), (9, 9)]
    q, kc, vc, k8, v8, meta = fp8_case(seqs, 1, 2, 32, 8, seed=9)
    out = paged_attention_triton(q, k8, v8, meta, 0.2, prefill_config=SMALL_PREFILL, window=8, kv_scales=SCALES)
    ref = paged_attention_ref(q.cpu(), k8.cpu(), v8.cpu(), _cpu(meta), 0.2, window=8, kv_scales=SCALES)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("norms,splits,prefetch", [(True, 3, 8), (False, 1, 0)])
def test_decode_with_the_epilogue_inside_stores_fp8(norms, splits, prefetch, monkeypatch):
    # a small decode batch runs the qkv epilogue inside the decode kernel (one kernel a layer):
    # with an FP8 cache it stores the newest K/V quantized, as the epilogue kernel does, and
    # reads them back after its barrier; the newest slots start as NaN, so a read before the
    # store fails
    from test_attention_kernels import (_decode_launches, attention_with_epilogue_inside, epilogue_case)

    from slipstream.ops.triton_attention import epilogue_in_decode_applies
    launches = _decode_launches(monkeypatch)
    qkv, epi, kc, vc, meta = epilogue_case([0, 1, 7, 9, 17, 50], 2, 2, 16, 8, torch.bfloat16, seed=12, norms=norms)
    k8, v8 = to_fp8(kc, SCALES.k_scale), to_fp8(vc, SCALES.v_scale)
    assert epilogue_in_decode_applies(qkv, epi, k8, meta, 4)
    cfg = replace(SMALL_DECODE, prefetch_batch=prefetch)
    k2, v2 = k8.clone(), v8.clone()
    q = qkv_epilogue_triton(qkv.clone(), epi.positions, epi.cos_sin_cache, k2, v2, meta.slot_mapping, 4, 2, 16,
                            epi.q_norm_weight, epi.k_norm_weight, epi.eps, kv_scales=SCALES)
    two = paged_attention_triton(q, k2, v2, meta, 0.25, decode_config=cfg, num_splits=splits, kv_scales=SCALES)
    one = attention_with_epilogue_inside(qkv, epi, k8, v8, meta, 4, decode_config=cfg, num_splits=splits,
                                         kv_scales=SCALES)
    assert [kw.get("EPILOGUE", False) for kw in launches] == [False, True]
    assert not torch.isnan(one.float()).any()
    for got, want in ((k8, k2), (v8, v2)):  # the same helpers: the same bytes
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    torch.testing.assert_close(one.float(), two.float(), atol=2e-2, rtol=2e-2)


def test_scales_reach_the_kernels():
    # the same FP8 bytes read with other scales: the output follows v_scale exactly (it is
    # linear in V) and k_scale changes the weights
    q, kc, vc, k8, v8, meta = fp8_case([(20, 1), (13, 1)], 1, 2, 32, 8, seed=10)
    base = paged_attention_triton(q, k8, v8, meta, 0.2, decode_config=SMALL_DECODE, kv_scales=SCALES)
    doubled = paged_attention_triton(q, k8, v8, meta, 0.2, decode_config=SMALL_DECODE,
                                     kv_scales=KVScales(SCALES.k_scale, 2 * SCALES.v_scale))
    torch.testing.assert_close(doubled.float(), 2 * base.float(), atol=1e-2, rtol=1e-2)
    other_k = paged_attention_triton(q, k8, v8, meta, 0.2, decode_config=SMALL_DECODE,
                                     kv_scales=KVScales(4 * SCALES.k_scale, SCALES.v_scale))
    assert (other_k.float() - base.float()).abs().max() > 0.05


# ----------------------------------------------------------------------------- GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("group", [4, 2])  # Llama-3-8B's 32 q / 8 KV heads, Qwen3-0.6B's 16 / 8
@pytest.mark.parametrize("splits", [None, 1, 16])
def test_gpu_decode_fp8_real_sizes(group, splits):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 8193, (32,), generator=g).tolist()
    lens[0], lens[1], lens[2] = 8192, 0, 1
    check_fp8_attention([(s, 1) for s in lens], 8, group, 128, 16, seed=2, num_splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_decode_fp8_prefetch(rows):
    check_fp8_attention([(700 + 13 * i, 1) for i in range(rows)], 8, 4, 128, 16, seed=3,
                        decode_config=DecodeConfig(prefetch_batch=8))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [4, 2])
def test_gpu_prefill_fp8_real_sizes(group):
    seqs = [(2048, 2048), (3000, 1000), (517, 1), (4096, 256), (0, 3)]
    check_fp8_attention(seqs, 8, group, 128, 16, seed=4)


@pytest.mark.gpu
def test_gpu_epilogue_fp8_real_sizes():
    T, Hq, Hk, D = 64, 32, 8, 128
    qkv, positions, cs, _, _ = epilogue_inputs(T, Hq, Hk, D, torch.bfloat16, seed=5)
    slots = torch.randperm(64 * 16)[:T].to(torch.int32)
    ref = [torch.zeros(64, 16, Hk, D, dtype=FP8_DTYPE) for _ in range(2)]
    qkv_epilogue_ref(qkv, positions, cs, *ref, slots, Hq, Hk, D, kv_scales=SCALES)
    dev = [torch.zeros_like(r, device="cuda") for r in ref]
    qkv_epilogue_triton(qkv.cuda(), positions.cuda(), cs.cuda(), *dev, slots.cuda(), Hq, Hk, D, kv_scales=SCALES)
    for got, want in zip(dev, ref):
        # one e4m3 step at most where the kernel's RoPE rounds k one bf16 ulp apart
        diff = (got.cpu().float() - want.float()).abs()
        assert (diff <= 2 * FP8_REL_ERR * want.float().abs() + 2.0 ** -9).all()
        assert (diff == 0).float().mean() >= 0.97
